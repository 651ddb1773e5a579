"""The SLO planner's I/O: scrape /metrics, decide, scale, export (controller process).

``PlannerLoop`` is a thread of the controller (deploy/controller.py) when ``tandem serve
--planner`` runs. Every ``interval_s`` it scrapes the router's /metrics and every serving worker's,
turns the change since the last scrape into an ``Observation`` (rates from counters: prompt
tokens and max_tokens arriving, and finished requests' generated tokens beside their max_tokens;
the TTFT p90 from the histogram's bucket deltas, the ITL's mean from its sum and count, gauges as
they are),
asks ``Planner.decide`` (deploy/planner.py) and applies the targets through the controller's
``scale`` -- unless ``dry_run``, which only logs. A decision is logged with its reasons and the
numbers behind them: at INFO when it changes something or its reasons differ from the last
one's, else at DEBUG. Every one is exported on the planner's own /metrics (``tandem_planner_*``).
"""
from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from deploy.planner import Decision, Observation, Planner
from protos.limits import ROLES
from worker.metrics_server import MetricsServer

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]   # (name, sorted labels) -> value


def parse_samples(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _buckets(samples: Samples, name: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for (n, labels), v in samples.items():
        if n == f"{name}_bucket":
            le = float(dict(labels)["le"])
            out[le] = out.get(le, 0.0) + v
    return out


def window_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of what a cumulative histogram observed between two scrapes (linear
    within the bucket, as Prometheus' histogram_quantile); None when it observed nothing. The
    +Inf bucket answers with the largest finite bound."""
    edges = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in edges]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for le, cumulative in zip(edges, counts):
        if cumulative >= rank:
            if le == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, cumulative
    return lower


@dataclass
class Scrape:
    """One round of /metrics: the router's samples and each worker's, by role."""

    at_s: float
    router: Samples
    workers: dict[str, dict[str, Samples]] = field(default_factory=dict)   # role -> /metrics address -> samples


def window_mean(before: Samples, after: Samples, name: str) -> float | None:
    """The mean of what a histogram observed between two scrapes (its _sum and _count deltas);
    None when it observed nothing."""
    count = _total(after, f"{name}_count") - _total(before, f"{name}_count")
    return (_total(after, f"{name}_sum") - _total(before, f"{name}_sum")) / count if count > 0 else None


def observe(before: Scrape, after: Scrape, replicas: dict[str, int], serving: dict[str, int] | None = None,
            held: dict[str, int] | None = None) -> Observation:
    """The interval between two scrapes as the planner sees it."""
    dt = max(after.at_s - before.at_s, 1e-3)

    def delta(name: str) -> float:
        return max(0.0, _total(after.router, name) - _total(before.router, name))

    def rate(name: str) -> float:
        return delta(name) / dt

    def worker_sum(role: str, name: str) -> float:
        return sum(_total(s, name) for s in after.workers.get(role, {}).values())

    # Per prefill worker seen in both scrapes (one that joined or left served part of the interval).
    then = before.workers.get("prefill", {})
    rates = {address: max(0.0, _total(s, "tandem_prompt_tokens_total") - _total(then[address],
                                                                                "tandem_prompt_tokens_total")) / dt
             for address, s in after.workers.get("prefill", {}).items() if address in then}
    busy = [rate for address, rate in rates.items()
            if _total(after.workers["prefill"][address], "tandem_num_requests_waiting") > 0]
    decode = list(after.workers.get("decode", {}).values())
    return Observation(
        replicas=dict(replicas),
        serving=None if serving is None else dict(serving),
        held=None if held is None else dict(held),
        prompt_tokens_per_s=rate("tandem_prompt_tokens_arrived_total"),
        prefill_tokens_per_s=sum(rates.values()),
        prefill_busy_tokens_per_s=sum(busy) / len(busy) if busy else 0.0,
        prefill_waiting=int(worker_sum("prefill", "tandem_num_requests_waiting")),
        decode_streams=worker_sum("decode", "tandem_num_requests_running")
        + worker_sum("decode", "tandem_num_requests_preallocated"),
        decode_running=worker_sum("decode", "tandem_num_requests_running"),
        max_tokens_per_s=rate("tandem_max_tokens_arrived_total"),
        finished_output_tokens=delta("tandem_generation_tokens_total"),
        finished_max_tokens=delta("tandem_max_tokens_finished_total"),
        decode_kv_usage=max((_total(s, "tandem_kv_cache_usage_ratio") for s in decode), default=0.0),
        ttft_p90_s=window_quantile(_buckets(before.router, "tandem_time_to_first_token_seconds"),
                                   _buckets(after.router, "tandem_time_to_first_token_seconds"), 0.9),
        itl_mean_s=window_mean(before.router, after.router, "tandem_inter_token_latency_seconds"))


def fetch_metrics(address: str, api_key: str = "") -> Samples:
    """GET http://address/metrics, parsed; raises OSError / ValueError."""
    request = urllib.request.Request(f"http://{address}/metrics",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=SCRAPE_TIMEOUT_S) as response:
        return parse_samples(response.read().decode())


class PlannerMetrics:
    """The planner's own series, on its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.target = Gauge("tandem_planner_target_replicas", "replicas the planner wants per role", ["role"],
                            registry=r)
        self.reason = Gauge("tandem_planner_reason", "the last decision's reason per role (deploy/planner.py "
                            "Reason: 0 hold, 1 TTFT SLO, 2 prefill load, 3 ITL SLO, 4 decode load, 5 KV full, "
                            "6 load fell, 7 pending, 8 cooldown, 9 at max, 10 no data, 11 starting, "
                            "12 draining, 13 rebalance)", ["role"], registry=r)
        self.decisions = Counter("tandem_planner_decisions", "decisions made, by whether they changed replicas",
                                 ["changed"], registry=r)
        self.ttft = Gauge("tandem_planner_observed_ttft_p90_seconds", "router TTFT p90 over the last interval",
                          registry=r)
        self.itl = Gauge("tandem_planner_observed_itl_mean_seconds", "router ITL mean over the last interval",
                         registry=r)
        self.held = Gauge("tandem_planner_held_replicas", "replicas holding a worker per role: asked for (serving "
                          "or starting) and still draining", ["role"], registry=r)
        self.prompt_load = Gauge("tandem_planner_prompt_load_tokens_per_second",
                                 "predicted prompt tokens/s (moving average)", registry=r)
        self.stream_load = Gauge("tandem_planner_decode_load_streams", "decode streams the planner sizes for: "
                                 "predicted from arrivals; before a request finished, the larger of the "
                                 "counted streams and the arrivals at a share of 1 (moving average)", registry=r)
        self.predicted_streams = Gauge("tandem_planner_predicted_decode_streams",
                                       "decode streams predicted from arrivals: max_tokens/s x the share finished "
                                       "requests used x the ITL SLO (NaN until a request finished)", registry=r)

    def record(self, decision: Decision, obs: Observation, planner: Planner) -> None:
        for role in ROLES:
            self.target.labels(role).set(decision.targets[role])
            self.reason.labels(role).set(int(decision.reasons[role]))
        self.decisions.labels(str(decision.changed).lower()).inc()
        self.ttft.set(obs.ttft_p90_s if obs.ttft_p90_s is not None else float("nan"))
        self.itl.set(obs.itl_mean_s if obs.itl_mean_s is not None else float("nan"))
        for role, count in (obs.held or obs.replicas).items():
            self.held.labels(role).set(count)
        self.prompt_load.set(planner.prompt_load or 0.0)
        self.stream_load.set(planner.decode_load or 0.0)
        predicted = planner.predicted_streams
        self.predicted_streams.set(float("nan") if predicted is None else predicted)


@dataclass
class Targets:
    """Where to scrape, read from the controller each interval."""

    router: str                              # the router's HTTP host:port
    workers: dict[str, list[str]]            # /metrics host:port of each serving replica, per role
    replicas: dict[str, int]                 # the controller's desired replicas per role
    serving: dict[str, int]                  # of those, running (registered and healthy)
    held: dict[str, int] | None = None       # replicas holding a worker: desired ones and draining ones


class PlannerLoop:
    def __init__(self, planner: Planner, targets: Callable[[], Targets | None],
                 scale: Callable[[str, int], object], api_key: str = "") -> None:
        self.planner = planner
        self.metrics = PlannerMetrics()
        self._targets, self._scale, self._api_key = targets, scale, api_key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-planner", daemon=True)
        self._server: MetricsServer | None = None
        self._last: Scrape | None = None
        self.decisions: list[Decision] = []     # the latest few, for `tandem status`

    def start(self, metrics_host: str) -> str:
        """Start the loop and the planner's /metrics; returns that server's host:port."""
        self._server = MetricsServer(self.metrics.registry)
        port = self._server.start(metrics_host, 0)
        self._thread.start()
        return f"{metrics_host}:{port}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(SCRAPE_TIMEOUT_S * 4 + 5)
        if self._server is not None:
            self._server.close()
            self._server = None

    def _run(self) -> None:
        while not self._stop.wait(self.planner.config.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad interval
                logger.exception("planner interval failed")

    def _scrape(self, targets: Targets) -> Scrape:
        scrape = Scrape(time.monotonic(), fetch_metrics(targets.router, self._api_key))
        for role, addresses in targets.workers.items():
            for address in addresses:
                try:
                    scrape.workers.setdefault(role, {})[address] = fetch_metrics(address)
                except (OSError, ValueError) as exc:    # a worker going away: the next round has the rest
                    logger.debug("planner: no /metrics from %s: %s", address, exc)
        return scrape

    def tick(self) -> Decision | None:
        """One interval: scrape, decide, apply; None when there is nothing to compare with yet."""
        targets = self._targets()
        if targets is None:
            return None
        try:
            scrape = self._scrape(targets)
        except (OSError, ValueError) as exc:
            logger.warning("planner: the router's /metrics did not answer (%s); skipping this interval", exc)
            return None
        before, self._last = self._last, scrape
        if before is None:
            return None
        obs = observe(before, scrape, targets.replicas, targets.serving, targets.held)
        decision = self.planner.decide(obs, scrape.at_s)
        self.metrics.record(decision, obs, self.planner)
        self.decisions = [*self.decisions[-9:], decision]
        reasons = ", ".join(f"{role} {decision.reasons[role].name}" for role in ROLES)
        if decision.changed:
            dry = "dry run, not applied: " if self.planner.config.dry_run else ""
            logger.info("planner: %sprefill %d -> %d, decode %d -> %d (%s); %s", dry, obs.replicas["prefill"],
                        decision.targets["prefill"], obs.replicas["decode"], decision.targets["decode"], reasons,
                        decision.note)
            if not self.planner.config.dry_run:
                for role in ROLES:
                    if decision.targets[role] != obs.replicas[role]:
                        self._scale(role, decision.targets[role])
        elif self.decisions[:-1] and decision.reasons != self.decisions[-2].reasons:
            logger.info("planner: no change (%s); %s", reasons, decision.note)
        else:
            logger.debug("planner: no change (%s); %s", reasons, decision.note)
        return decision
