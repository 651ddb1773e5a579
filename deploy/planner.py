"""The SLO planner's decision: how many prefill and decode replicas the load needs (controller process).

Pure: ``Planner.decide(observation, now_s)`` takes one interval's ``Observation`` (what the
router's and workers' /metrics said, deploy/planner_loop.py scrapes them) and returns a
``Decision`` (target replicas per role, a reason per role); no I/O, so tests drive it with made-up
observations. The loop applies a decision through the controller's ``scale``.

The idea is DistServe's and NVIDIA Dynamo's planner: a worker's *capacity within the SLO* times
the *predicted load* gives the replicas needed, not a threshold on one latency.

- **prefill**: capacity = prompt tokens/s one prefill worker computes (the sim profile's, else
  learned: the tokens/s of the workers that had prompts queued in an interval whose TTFT broke
  the SLO, so they ran flat out). Load = a moving average of the prompt tokens/s arriving at the router. Needed =
  ceil(load / (capacity x ``target_utilization``)): a worker kept below full use keeps its queue,
  and so the TTFT, short. A give-back for a fallen load also asks the prompt tokens/s averaged over
  ``arrival_window_s`` from the first prompt on to have fallen: a few prompts an interval make the
  moving average dip by chance, and before any prompt arrived there is no load to size for.
- **decode**: capacity = streams one decode worker runs with its ITL within the SLO (the profile's
  step-time model solved for the batch, else learned: running streams per worker x SLO / observed
  ITL -- with the profile's fixed step part known, x (SLO - fixed) / (ITL - fixed) --, from
  intervals whose ITL came within ``LEARN_ITL_FRACTION`` of the SLO: a step has a fixed part, so
  far below the SLO the proportion says nothing). Load = *predicted* from what arrives
  (Little's law, as Dynamo's planner): streams = arrival rate x expected output length x time per
  output token = (the ``max_tokens`` arriving per second, averaged over ``arrival_window_s``, or over
  the time since the first request arrived if that is shorter: the planner starts before the
  traffic, and the idle intervals before it would hold a new load's first window low; and from the
  newest ``FALL_INTERVALS`` intervals when those brought under ``FALL_FRACTION`` of what the window
  predicted: a fall in arrivals, not noise, so decode follows it in 3 intervals, not 2-3 windows) x (the
  share of ``max_tokens`` that finished requests used, learned) x the ITL SLO. The SLO, not the observed ITL,
  because the capacity is counted in streams at the SLO's pace too: needed = output tokens/s /
  (a worker's tokens/s within the SLO). Until a request has finished (no share known) the load is
  the larger of the prediction at a share of 1 (every request using all its ``max_tokens``: an
  upper bound, so decode errs on the side of more) and a moving average of the streams counted on
  the decode workers: counted streams lag the arrivals by a stream's life, so a load's first
  stream life, before one finishes, would be sized on a fraction of it. The prediction sees a load change
  when the requests arrive, not a stream life later when the running streams have changed: at a
  chat -> document change decode gives replicas back while chat streams still run -- as long as the
  replicas left hold those streams within the SLO (one fewer must carry the streams running at
  its full capacity, besides the predicted load at the shrink's utilization). The running streams
  are projected ``cooldown_s`` ahead along their moving rate of change when they fall: a replica
  given back keeps its streams while it drains, until they end or the router's
  ``--drain-move-after-s`` moves them, and at a load change the old streams end at the rate they came. The ITL is the
  interval's *mean* (the router histogram's sum / count, exact): a percentile read off buckets of 5
  and 10 ms cannot say whether 6 ms was kept.
- **correction**: when the observed TTFT (ITL) p90 breaks its SLO although the model says the
  replicas suffice, the model is wrong: one replica more (Dynamo's correction factor, as a step) --
  unless a replica asked for is still starting, or the prefill workers compute more tokens/s than
  arrive (a backlog from before the last scale-up going down). A decode pool nearly full of KV
  also asks for one more.

Hysteresis, so a noisy signal does not flap: a role grows only after ``up_after`` intervals in a
row asked for more, and shrinks (one replica at a time) only after ``down_after`` intervals in a
row in which one replica fewer would still carry the load at ``down_utilization`` (below the
target: headroom) and the SLO was met with margin. After any change a role is left alone for
``cooldown_s``. Targets are clamped to [1, max_workers - 1] per role and ``max_workers`` in all,
counting a replica that still drains (it holds its accelerator until its last stream ends); when the
two roles ask for more than that, the room is shared: the larger growth is cut first.

**Trading under the budget.** With ``max_workers`` reached, a role whose growth was cut for
``up_after`` intervals takes a replica from the other role as soon as that one would still carry
its load at ``target_utilization`` with its SLO met now (the other gives it back at once, not after
``down_after`` intervals: the load has moved, it has not fallen; its cooldown still holds). The
growth follows when the replica given back has drained.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from engine.sim.latency import LatencyModel
from protos.limits import ROLES

# The context a decode stream is assumed to hold when a profile's step-time model is solved for the
# batch that meets the ITL SLO (a prompt of ~1k tokens and its output); what ITL is then observed
# corrects it (Planner._learn).
PROFILE_DECODE_CONTEXT_TOKENS = 1024
# The decode capacity is learned only from intervals whose mean ITL was at least this fraction of the
# SLO: a step is base + per-stream cost, so scaling a batch by SLO / ITL from far below misjudges it
# (at 4 ms of a 6 ms SLO, most of the 4 ms is the fixed part).
LEARN_ITL_FRACTION = 0.85
# The arriving max_tokens are believed to have fallen (a load changed, not noise) when the newest
# FALL_INTERVALS intervals together brought under FALL_FRACTION of what the window's average predicts
# for them: then the window starts again from those intervals. For a chat load of ~3.5 requests an
# interval (benchmarks/planner.py's), three intervals bring 10.5 on average and at most 3 with a
# Poisson probability of 0.7% (simulated: one 37-interval chat phase in 14 restarts once; what then
# reads low for a few intervals cannot take a decode replica from streams still running, as
# _decode_fits holds them); a chat -> documents change (64 max_tokens instead of 768) brings ~6%.
FALL_INTERVALS = 3
FALL_FRACTION = 1 / 3


@dataclass
class FromFirstAverage:
    """An exponential average that starts at the first non-zero value: its sum and its weight so far
    (1 - (1 - w)^k over the k values since then), whose ratio is the average, so a new load's first
    intervals are averaged as they are instead of against the zeros before them."""

    total: float = 0.0
    weight: float = 0.0

    def add(self, value: float, w: float) -> None:
        if self.weight > 0 or value > 0:
            self.total = w * value + (1 - w) * self.total
            self.weight = w + (1 - w) * self.weight

    def restart(self, values: list[float], w: float) -> None:
        """Start again as if ``values`` were all it had seen (their plain mean, at their weight)."""
        self.weight = 1.0 - (1 - w) ** len(values)
        self.total = self.weight * sum(values) / len(values)

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight else None


class Reason(enum.IntEnum):
    """Why a role's target is what it is (exported as ``tandem_planner_reason``)."""

    HOLD = 0                # the replicas carry the load; nothing to do
    TTFT_SLO = 1            # prefill: TTFT p90 over its SLO although the model said enough
    PREFILL_LOAD = 2        # prefill: predicted prompt tokens/s need more workers
    ITL_SLO = 3             # decode: ITL p90 over its SLO although the model said enough
    DECODE_LOAD = 4         # decode: predicted streams need more workers
    KV_FULL = 5             # decode: the decode workers' KV pools are nearly full
    LOAD_FELL = 6           # one replica fewer carries the load with headroom: given back
    PENDING = 7             # a change is asked for, not yet for enough intervals in a row
    COOLDOWN = 8            # a change is asked for, but the role changed less than cooldown_s ago
    AT_MAX = 9              # more is needed than --max-workers allows
    NO_DATA = 10            # no capacity known yet and no SLO broken: nothing to go on
    STARTING = 11           # the SLO is broken but replicas asked for are still starting: wait for them
    DRAINING = 12           # TTFT broken by a backlog the prefill workers are already working off
    REBALANCE = 13          # at --max-workers: given to the other role, which needs it (its load moved)


@dataclass(frozen=True)
class PlannerConfig:
    ttft_slo_s: float
    itl_slo_s: float
    max_workers: int = 8
    interval_s: float = 5.0
    target_utilization: float = 0.8     # a role is sized to run at this fraction of its capacity
    down_utilization: float = 0.6       # one fewer replica must carry the load at this fraction
    slo_margin: float = 0.8             # a shrink needs the observed p90 below this fraction of the SLO
    up_after: int = 2                   # intervals in a row that ask for more before it is applied
    down_after: int = 6                 # intervals in a row that allow fewer before one is given back
    cooldown_s: float = 15.0
    load_smoothing: float = 0.5         # weight of the newest interval in the load moving averages
    # The max_tokens arriving (decode's predicted load) are averaged over about this long: a chat
    # load of ~2 requests/s of 768 tokens brings 0-8 requests in a 2 s interval, so one interval's
    # count swings the prediction by half (measured: 13 -> 41 -> 20 -> 45 streams, one interval each).
    arrival_window_s: float = 10.0
    kv_full: float = 0.9                # decode KV usage that asks for another decode replica
    dry_run: bool = False

    def __post_init__(self) -> None:
        if not (self.ttft_slo_s > 0 and self.itl_slo_s > 0):
            raise ValueError(f"--ttft-slo-ms and --itl-slo-ms must be > 0 (got {self.ttft_slo_s * 1e3:g} and "
                             f"{self.itl_slo_s * 1e3:g})")
        if self.max_workers < 2:
            raise ValueError(f"--max-workers must be >= 2 (one prefill and one decode), got {self.max_workers}")
        if not self.interval_s > 0:
            raise ValueError(f"--planner-interval-s must be > 0, got {self.interval_s}")
        if not 0 < self.down_utilization < self.target_utilization <= 1:
            raise ValueError("need 0 < down_utilization < target_utilization <= 1, got "
                             f"{self.down_utilization} and {self.target_utilization}")
        if self.up_after < 1 or self.down_after < 1:
            raise ValueError(f"up_after and down_after must be >= 1, got {self.up_after} and {self.down_after}")
        if not 0 < self.load_smoothing <= 1:
            raise ValueError(f"load_smoothing must be in (0, 1], got {self.load_smoothing}")
        if not self.arrival_window_s >= 0:
            raise ValueError(f"arrival_window_s must be >= 0, got {self.arrival_window_s}")


@dataclass(frozen=True)
class Observation:
    """One interval of the deployment, from the router's and workers' /metrics."""

    replicas: dict[str, int]                 # asked for now (the controller's desired), per role
    serving: dict[str, int] | None = None    # of those, serving now; None: all of them
    # Replicas that hold a worker now: the asked-for ones and those still draining; None: replicas.
    held: dict[str, int] | None = None
    prompt_tokens_per_s: float = 0.0         # prompt tokens arriving at the router
    prefill_tokens_per_s: float = 0.0        # prompt tokens the prefill workers computed
    # Per worker, the mean over the prefill workers with prompts still queued at the end: they ran
    # flat out, so this is what one computes (0: none was queued).
    prefill_busy_tokens_per_s: float = 0.0
    prefill_waiting: int = 0                 # requests queued at the prefill workers, at the end
    decode_streams: float = 0.0              # streams running (or reserved) on decode workers, at the end
    decode_running: float | None = None      # of those, decoding (not reserved); None: decode_streams
    # The output arriving requests may ask for: their max_tokens per second, at the router's dispatch.
    max_tokens_per_s: float = 0.0
    # Requests that finished in the interval: the tokens they generated and the max_tokens they had.
    finished_output_tokens: float = 0.0
    finished_max_tokens: float = 0.0
    decode_kv_usage: float = 0.0             # the fullest decode worker's KV usage ratio
    ttft_p90_s: float | None = None          # router, over the interval; None: no request got a first token
    itl_mean_s: float | None = None          # router, mean over the interval's tokens; None: none streamed


@dataclass(frozen=True)
class Capacity:
    """What one worker carries within the SLOs; None: not known (yet)."""

    prefill_tokens_per_s: float | None = None
    decode_streams: float | None = None
    # The fixed part of a decode step (seconds: what a step takes with no stream), from a profile;
    # None: not known, and the ITL is taken as proportional to the streams.
    decode_base_s: float | None = None


def profile_capacity(profile: dict[str, Any], itl_slo_s: float,
                     context_tokens: int = PROFILE_DECODE_CONTEXT_TOKENS) -> Capacity:
    """A worker's capacity from a simulated engine's profile (engine/sim/latency.py): prompt tokens/s
    in full prefill chunks, and the largest batch whose decode step fits the ITL SLO."""
    model = LatencyModel.fit(profile)
    chunk = int(profile.get("chunked_prefill_size") or 512)
    prefill = 1e3 * chunk / (model.base_ms + model.per_prefill_token_ms * chunk)
    per_stream_ms = model.per_seq_ms + model.per_context_token_ms * context_tokens
    room_ms = itl_slo_s * 1e3 - model.base_ms
    decode = room_ms / per_stream_ms if per_stream_ms > 0 else math.inf
    return Capacity(prefill, max(decode, 1.0), model.base_ms / 1e3)


@dataclass(frozen=True)
class Decision:
    targets: dict[str, int]
    reasons: dict[str, Reason]
    changed: bool
    note: str                                # one line: the numbers the decision came from


@dataclass
class _RoleState:
    up_streak: int = 0
    down_streak: int = 0
    changed_at_s: float = -math.inf


def _ratio(observed: float | None, slo: float) -> float:
    return 0.0 if observed is None else observed / slo


@dataclass
class Planner:
    config: PlannerConfig
    capacity: Capacity = field(default_factory=Capacity)
    prompt_load: float | None = None        # moving average, prompt tokens/s
    stream_load: float | None = None        # moving average, decode streams counted on the workers
    # The max_tokens/s arriving, averaged from the first arrival on (asked_load).
    _asked: FromFirstAverage = field(default_factory=FromFirstAverage)
    # The newest intervals' max_tokens/s (up to FALL_INTERVALS of them), for the fall test below.
    _asked_recent: list[float] = field(default_factory=list)
    # The prompt tokens/s arriving over the same window, from the first prompt on (prompt_window_load):
    # what a prefill give-back is checked against besides prompt_load.
    _prompt: FromFirstAverage = field(default_factory=FromFirstAverage)
    # The running (decoding) decode streams: the last count, when, and their moving rate of change
    # (streams/s, over intervals with the same replicas serving): the running streams' projection.
    _last_running: float | None = None
    _last_at_s: float | None = None
    running_slope: float = 0.0
    # Moving sums of finished requests' generated tokens and their max_tokens (their ratio: the share
    # of max_tokens a request uses); 0 until one finished.
    _finished_output: float = 0.0
    _finished_max: float = 0.0
    _roles: dict[str, _RoleState] = field(default_factory=lambda: {role: _RoleState() for role in ROLES})
    _last_serving: dict[str, int] | None = None

    def decide(self, obs: Observation, now_s: float) -> Decision:
        self._learn(obs, now_s)
        need, reasons = self._needed(obs)
        cap = self.config.max_workers - 1          # the other role keeps at least one
        need = {role: min(max(1, n), cap) for role, n in need.items()}
        targets: dict[str, int] = {}
        for role in ROLES:
            targets[role], reasons[role] = self._hysteresis(role, obs, need[role], reasons[role], now_s)
        # The cap again, with what still drains (it holds its worker): the room left is shared, one
        # replica at a time off the larger growth.
        held = obs.held or obs.replicas
        while sum(max(targets[r], held[r]) for r in ROLES) > self.config.max_workers:
            role = max(ROLES, key=lambda r: targets[r] - obs.replicas[r])
            if targets[role] <= obs.replicas[role]:
                break                              # over the cap without growing (scaled by hand): left as is
            targets[role] -= 1
            reasons[role] = Reason.AT_MAX
        self._rebalance(obs, targets, reasons, now_s)
        changed = targets != obs.replicas
        for role in ROLES:
            if targets[role] != obs.replicas[role]:
                self._roles[role] = _RoleState(changed_at_s=now_s)
        return Decision(targets, reasons, changed, self._note(obs))

    # -- the model ---------------------------------------------------------------------------

    def _learn(self, obs: Observation, now_s: float) -> None:
        a = self.config.load_smoothing
        self.prompt_load = obs.prompt_tokens_per_s if self.prompt_load is None else (
            a * obs.prompt_tokens_per_s + (1 - a) * self.prompt_load)
        self.stream_load = obs.decode_streams if self.stream_load is None else (
            a * obs.decode_streams + (1 - a) * self.stream_load)
        # An exponential average with a time constant of arrival_window_s, at interval_s a step.
        w = 1.0 - math.exp(-self.config.interval_s / self.config.arrival_window_s) if self.config.arrival_window_s \
            else 1.0
        self._prompt.add(obs.prompt_tokens_per_s, w)
        if self._asked.weight > 0 or obs.max_tokens_per_s > 0:
            expected = self.asked_load
            self._asked.add(obs.max_tokens_per_s, w)
            self._asked_recent = [*self._asked_recent[1 - FALL_INTERVALS:], obs.max_tokens_per_s]
            recent = self._asked_recent
            if len(recent) == FALL_INTERVALS and sum(recent) < FALL_FRACTION * FALL_INTERVALS * expected:
                # The arrivals fell (a load changed, not noise): the window starts again from these
                # intervals, as if they were all it had seen.
                self._asked.restart(recent, w)
        serving_now = obs.serving or obs.replicas
        running = obs.decode_streams if obs.decode_running is None else obs.decode_running
        draining = (obs.held or obs.replicas)["decode"] > obs.replicas["decode"]
        if self._last_running is not None and self._last_at_s is not None and now_s > self._last_at_s \
                and serving_now == self._last_serving and not draining:
            # Only while the same decode workers serve and none drains: a replica that comes or goes
            # takes its streams in or out of the count.
            slope = (running - self._last_running) / (now_s - self._last_at_s)
            self.running_slope = a * slope + (1 - a) * self.running_slope
        self._last_running, self._last_at_s = running, now_s
        self._finished_output = w * obs.finished_output_tokens + (1 - w) * self._finished_output
        self._finished_max = w * obs.finished_max_tokens + (1 - w) * self._finished_max
        prefill, decode = self.capacity.prefill_tokens_per_s, self.capacity.decode_streams
        serving = obs.serving or obs.replicas
        # A replica that came or went during the interval served part of it: per worker means nothing.
        steady, self._last_serving = serving == self._last_serving, dict(serving)
        per_worker = obs.prefill_tokens_per_s / max(1, serving["prefill"]) if steady else 0.0
        busy = obs.prefill_busy_tokens_per_s
        if busy > 0 and _ratio(obs.ttft_p90_s, self.config.ttft_slo_s) > 1:
            # Prompts queued long enough to break the SLO: those workers ran flat out, so this is
            # what one carries. (Not the total over all workers: a router policy may leave one idle.)
            prefill = busy if prefill is None else 0.5 * (prefill + busy)
        elif prefill is not None and per_worker > prefill:
            prefill = per_worker
        streams_per_worker = obs.decode_streams / max(1, serving["decode"])
        informative = obs.itl_mean_s is not None and obs.itl_mean_s >= LEARN_ITL_FRACTION * self.config.itl_slo_s
        # A worker far from full says nothing about its batch capacity either (its ITL may be a KV
        # transfer's gap, or the host's CPU): only one running at least half what it is thought to hold.
        loaded = streams_per_worker >= max(1.0, 0.5 * (decode or 0.0))
        if steady and informative and loaded:
            # ITL grows with the batch: scaled to the SLO, the streams a worker holds within it. With
            # the step's fixed part known (a profile), only the part above it grows with the streams.
            itl, slo, base = obs.itl_mean_s or 1.0, self.config.itl_slo_s, self.capacity.decode_base_s or 0.0
            if itl - base < (1 - LEARN_ITL_FRACTION) * slo:
                base = 0.0                         # the profile's fixed part is off here: proportional
            estimate = streams_per_worker * (slo - base) / (itl - base)
            decode = estimate if decode is None else 0.5 * (decode + estimate)
        self.capacity = Capacity(prefill, decode, self.capacity.decode_base_s)

    @property
    def output_share(self) -> float | None:
        """The share of ``max_tokens`` finished requests generated (moving); None before one finished."""
        return min(1.0, self._finished_output / self._finished_max) if self._finished_max > 0 else None

    @property
    def predicted_streams(self) -> float | None:
        """Decode streams the arriving requests make at the SLO's pace (Little's law: arrivals x
        expected output x time per output token); None until a finished request gave the share."""
        share = self.output_share
        return None if share is None else self.asked_load * share * self.config.itl_slo_s

    @property
    def asked_load(self) -> float:
        """Moving average of the ``max_tokens``/s arriving, from the first arrival on (0 before)."""
        return self._asked.value or 0.0

    @property
    def upper_streams(self) -> float:
        """The predicted streams if every request used all its ``max_tokens`` (a share of 1)."""
        return self.asked_load * self.config.itl_slo_s

    @property
    def decode_load(self) -> float | None:
        """What decode is sized for: the predicted streams; until a request finished, the larger of
        the upper bound and the counted streams (which lag the arrivals by a stream's life)."""
        predicted = self.predicted_streams
        if predicted is not None:
            return predicted
        return None if self.stream_load is None else max(self.upper_streams, self.stream_load)

    @property
    def prompt_window_load(self) -> float | None:
        """The prompt tokens/s arriving averaged over ``arrival_window_s`` from the first prompt on;
        None before one arrived."""
        return self._prompt.value

    def projected_running(self, running: float) -> float:
        """The running decode streams ``cooldown_s`` ahead along their moving rate of change, when
        they fall (never when they rise: a give-back is checked against the larger)."""
        return max(0.0, running + min(0.0, self.running_slope) * self.config.cooldown_s)

    def _decode_fits(self, replicas: int, utilization: float, obs: Observation) -> bool:
        """Whether ``replicas`` decode workers carry the predicted load at ``utilization`` of their
        capacity and hold the streams running (at full capacity: the running streams end, or move
        to those left, while the new load is what arrives). A replica given back keeps its streams
        while it drains -- until they end, or until the router's ``--drain-move-after-s`` moves
        them -- so the running streams are the ones projected ``cooldown_s`` ahead along their fall:
        at a load change the old load's streams end at the rate it brought them."""
        capacity = self.capacity.decode_streams
        if not capacity:
            return False
        running = obs.decode_streams if obs.decode_running is None else obs.decode_running
        fits_load = (self.decode_load or 0.0) <= replicas * capacity * utilization
        return fits_load and (self.predicted_streams is None or self.projected_running(running) <= replicas * capacity)

    def _needed(self, obs: Observation) -> tuple[dict[str, int], dict[str, Reason]]:
        c = self.config
        need, reasons = dict(obs.replicas), {role: Reason.HOLD for role in ROLES}
        for role, load, capacity, up_reason, slo_reason, observed, slo in (
                ("prefill", self.prompt_load, self.capacity.prefill_tokens_per_s, Reason.PREFILL_LOAD,
                 Reason.TTFT_SLO, obs.ttft_p90_s, c.ttft_slo_s),
                ("decode", self.decode_load, self.capacity.decode_streams, Reason.DECODE_LOAD,
                 Reason.ITL_SLO, obs.itl_mean_s, c.itl_slo_s)):
            current = obs.replicas[role]
            if capacity:
                need[role] = max(1, math.ceil((load or 0.0) / (capacity * c.target_utilization)))
                if need[role] > current:
                    reasons[role] = up_reason
            elif _ratio(observed, slo) <= 1:
                reasons[role] = Reason.NO_DATA
            starting = obs.serving is not None and obs.serving[role] < current
            if role == "decode" and self._kv_full(obs) and need[role] <= current:
                slo_reason, observed = Reason.KV_FULL, math.inf
            # A backlog (from before a scale-up) shrinking by more than a tenth of the load a second.
            draining = role == "prefill" and obs.prefill_tokens_per_s > 1.1 * obs.prompt_tokens_per_s
            if _ratio(observed, slo) > 1 and need[role] <= current:
                # What is starting may be all that was missing: one more only once it serves, and
                # only while the queue does not go down.
                if starting:
                    reasons[role] = Reason.STARTING
                elif draining:
                    reasons[role] = Reason.DRAINING
                else:
                    need[role], reasons[role] = current + 1, slo_reason
        return need, reasons

    def _can_shrink(self, role: str, current: int, obs: Observation) -> bool:
        """Whether ``current - 1`` replicas would carry the predicted load with headroom, and the
        SLO is met with margin now."""
        c = self.config
        if current <= 1 or (obs.serving is not None and obs.serving[role] < current):
            return False
        if role == "prefill":
            capacity, observed, slo = self.capacity.prefill_tokens_per_s, obs.ttft_p90_s, c.ttft_slo_s
            busy = obs.prefill_waiting > current
            window = self.prompt_window_load
            if not capacity or busy or window is None or _ratio(observed, slo) > c.slo_margin:
                return False
            # The load that fell must have fallen in the window's average too: the interval average
            # of a few prompts an interval dips below the threshold by chance.
            return max(self.prompt_load or 0.0, window) <= (current - 1) * capacity * c.down_utilization
        busy = self._kv_full(obs, c.kv_full * c.down_utilization / c.target_utilization)
        # Streams still rising (a load building up, not one that fell) keep every replica.
        busy = busy or obs.decode_streams > 1.1 * (self.stream_load or 0.0)
        if busy or _ratio(obs.itl_mean_s, c.itl_slo_s) > c.slo_margin:
            return False
        return self._decode_fits(current - 1, c.down_utilization, obs)

    def _kv_full(self, obs: Observation, threshold: float | None = None) -> bool:
        """The decode pools nearly full of the streams' own KV. Not while prompts queue at the
        prefill workers: a decode worker reserves a request's blocks before its prompt is computed,
        so a prefill backlog fills the pool with reservations that another decode worker would not
        serve any sooner (it would take more)."""
        full = obs.decode_kv_usage >= (self.config.kv_full if threshold is None else threshold)
        return full and obs.prefill_waiting <= obs.replicas["prefill"]

    def _rebalance(self, obs: Observation, targets: dict[str, int], reasons: dict[str, Reason], now_s: float
                   ) -> None:
        """At the cap: a role whose growth was cut (AT_MAX, so asked for ``up_after`` intervals in a
        row) takes a replica from the other, if that one carries its load with one fewer at
        ``target_utilization``, meets its SLO now and is not in its cooldown. (Not ``slo_margin``:
        a decode step's fixed part may be most of the ITL SLO, so a busy decode pool never has that
        margin; the load model is what says one fewer suffices.)"""
        c = self.config
        for taker, giver in (("prefill", "decode"), ("decode", "prefill")):
            current = obs.replicas[giver]
            if reasons[taker] != Reason.AT_MAX or targets[giver] != current or current <= 1:
                continue
            if obs.serving is not None and obs.serving[giver] < current:
                continue
            if now_s - self._roles[giver].changed_at_s < c.cooldown_s:
                continue
            if giver == "prefill":
                capacity, observed = self.capacity.prefill_tokens_per_s, obs.ttft_p90_s
                # The prompt load averaged over the window at target_utilization (a replica handed
                # over is gone for tens of seconds: one interval's noise says little about that), and
                # the moving average within full capacity (a load rising past the window's lag keeps it).
                fewer = (current - 1) * (capacity or 0.0)
                window = self.prompt_window_load or 0.0
                fits = bool(capacity) and obs.prefill_waiting <= current and _ratio(observed, c.ttft_slo_s) <= 1 \
                    and window <= fewer * c.target_utilization and (self.prompt_load or 0.0) <= fewer
            else:
                fits = not self._kv_full(obs) and _ratio(obs.itl_mean_s, c.itl_slo_s) <= 1 \
                    and self._decode_fits(current - 1, c.target_utilization, obs)
            if fits:
                targets[giver], reasons[giver] = current - 1, Reason.REBALANCE
                return

    def _hysteresis(self, role: str, obs: Observation, need: int, reason: Reason, now_s: float
                    ) -> tuple[int, Reason]:
        c = self.config
        state, current = self._roles[role], obs.replicas[role]
        if need > current:
            state.up_streak, state.down_streak = state.up_streak + 1, 0
            if state.up_streak < c.up_after:
                return current, Reason.PENDING
        elif self._can_shrink(role, current, obs):
            state.up_streak, state.down_streak = 0, state.down_streak + 1
            if state.down_streak < c.down_after:
                return current, Reason.PENDING
            need, reason = current - 1, Reason.LOAD_FELL
        else:
            state.up_streak = state.down_streak = 0
            return current, reason if reason in (Reason.NO_DATA, Reason.STARTING, Reason.DRAINING) else Reason.HOLD
        if now_s - state.changed_at_s < c.cooldown_s:
            return current, Reason.COOLDOWN
        return need, reason

    def _note(self, obs: Observation) -> str:
        def num(x: float | None, scale: float = 1.0, fmt: str = ".0f") -> str:
            return "-" if x is None else format(x * scale, fmt)

        return (f"replicas P{obs.replicas['prefill']} D{obs.replicas['decode']}; "
                f"TTFT p90 {num(obs.ttft_p90_s, 1e3)} ms "
                f"(SLO {self.config.ttft_slo_s * 1e3:.0f}), ITL mean {num(obs.itl_mean_s, 1e3, '.1f')} ms "
                f"(SLO {self.config.itl_slo_s * 1e3:.0f}); prompt load {num(self.prompt_load)} tok/s, prefill "
                f"capacity {num(self.capacity.prefill_tokens_per_s)} tok/s/worker, {obs.prefill_waiting} waiting; "
                f"decode load {num(self.decode_load, fmt='.1f')} streams (counted {num(self.stream_load, fmt='.1f')}, "
                f"predicted {num(self.predicted_streams, fmt='.1f')}, upper {self.upper_streams:.1f}), capacity "
                f"{num(self.capacity.decode_streams, fmt='.1f')} streams/worker, KV {obs.decode_kv_usage:.0%}")
