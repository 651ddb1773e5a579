"""The SLO planner's decision logic (deploy/planner.py): made-up observations in, targets out."""
from __future__ import annotations

import json
import math

import pytest

from deploy.planner import Capacity, Observation, Planner, PlannerConfig, Reason, profile_capacity
from tests.engine.sim.profiles import write_fast_profile

CONFIG = PlannerConfig(ttft_slo_s=0.5, itl_slo_s=0.05, max_workers=6, interval_s=1.0, up_after=2, down_after=4,
                       cooldown_s=3.0)
KNOWN = Capacity(prefill_tokens_per_s=1000.0, decode_streams=10.0)


def obs(p: int, d: int, **kw) -> Observation:
    return Observation(replicas={"prefill": p, "decode": d}, **kw)


def run(planner: Planner, observations: list[Observation], start_s: float = 0.0) -> list:
    """Decide on each observation one interval apart; the replicas follow the targets (the next
    observation's replicas are overridden with the last targets)."""
    decisions, replicas = [], dict(observations[0].replicas)
    for i, o in enumerate(observations):
        o = Observation(**{**o.__dict__, "replicas": dict(replicas)})
        d = planner.decide(o, start_s + i)
        replicas = dict(d.targets)
        decisions.append(d)
    return decisions


def test_adds_prefill_when_ttft_breaks_under_rising_prompt_load():
    planner = Planner(CONFIG, KNOWN)
    calm = obs(1, 1, prompt_tokens_per_s=400, prefill_tokens_per_s=400, ttft_p90_s=0.1, itl_mean_s=0.01)
    hot = obs(1, 1, prompt_tokens_per_s=1500, prefill_tokens_per_s=1000, prefill_waiting=6, ttft_p90_s=1.2,
              itl_mean_s=0.01)
    ds = run(planner, [calm, calm, hot, hot, hot])
    assert [d.targets["prefill"] for d in ds] == [1, 1, 1, 2, 2]
    assert [d.reasons["prefill"] for d in ds[:4]] == [Reason.HOLD, Reason.HOLD, Reason.PENDING, Reason.PREFILL_LOAD]
    assert ds[3].changed and all(d.targets["decode"] == 1 for d in ds)
    assert ds[4].reasons["prefill"] in (Reason.PENDING, Reason.COOLDOWN)


def test_learns_prefill_capacity_from_a_saturated_interval():
    planner = Planner(CONFIG)            # nothing known: no profile
    hot = obs(1, 1, prompt_tokens_per_s=2500, prefill_tokens_per_s=1000, prefill_busy_tokens_per_s=1000,
              prefill_waiting=10, ttft_p90_s=2.0)
    ds = run(planner, [hot, hot])
    assert planner.capacity.prefill_tokens_per_s == 1000.0
    # EMA of 2500 tok/s over 1000 x 0.8 per worker: 4 workers.
    assert ds[1].targets["prefill"] == 4 and ds[1].reasons["prefill"] == Reason.PREFILL_LOAD


def test_learns_a_lower_capacity_only_from_workers_that_ran_flat_out():
    planner = Planner(CONFIG, KNOWN)
    # Two workers, 1200 tok/s between them, the TTFT broken: a router policy sent most to one (its
    # queue: 1000 tok/s), the other idled. The capacity is the busy one's, not 600.
    o = obs(2, 1, prompt_tokens_per_s=1200, prefill_tokens_per_s=1200, prefill_busy_tokens_per_s=1000,
            prefill_waiting=5, ttft_p90_s=2.0)
    planner.decide(o, 0.0)
    assert planner.capacity.prefill_tokens_per_s == 1000.0
    # No queue: nothing learned from a TTFT broken elsewhere (say, a slow transfer).
    planner.decide(obs(2, 1, prompt_tokens_per_s=500, prefill_tokens_per_s=500, ttft_p90_s=2.0), 1.0)
    assert planner.capacity.prefill_tokens_per_s == 1000.0


def test_ttft_over_slo_adds_one_when_the_model_says_enough():
    planner = Planner(CONFIG, KNOWN)
    o = obs(2, 1, prompt_tokens_per_s=600, prefill_tokens_per_s=600, ttft_p90_s=0.9)
    ds = run(planner, [o, o])
    assert ds[1].targets["prefill"] == 3 and ds[1].reasons["prefill"] == Reason.TTFT_SLO


def test_waits_for_a_starting_replica_before_adding_another():
    planner = Planner(CONFIG, KNOWN)
    # Two asked for, one serving yet; the TTFT still broken (the backlog of the one), the load fits two.
    o = Observation(replicas={"prefill": 2, "decode": 1}, serving={"prefill": 1, "decode": 1},
                    prompt_tokens_per_s=1200, prefill_tokens_per_s=1000, prefill_waiting=5, ttft_p90_s=2.0)
    ds = [planner.decide(o, float(i)) for i in range(6)]
    assert all(d.targets["prefill"] == 2 and d.reasons["prefill"] == Reason.STARTING for d in ds)
    # It serves; the TTFT is still broken by the backlog, which two workers work off (2000 tok/s
    # computed, 1200 arriving): nothing more.
    o = Observation(**{**o.__dict__, "serving": {"prefill": 2, "decode": 1}, "prefill_tokens_per_s": 2000})
    ds = [planner.decide(o, float(i)) for i in range(6, 10)]
    assert all(d.targets["prefill"] == 2 and d.reasons["prefill"] == Reason.DRAINING for d in ds)
    # The queue no longer goes down (as many tokens arrive as are computed) and the TTFT stays broken:
    # one more (the load's moving average, 1800 tok/s, now needs it too).
    o = Observation(**{**o.__dict__, "prompt_tokens_per_s": 2000})
    ds = [planner.decide(o, float(i)) for i in range(10, 12)]
    assert ds[0].reasons["prefill"] == Reason.PENDING
    assert ds[1].targets["prefill"] == 3 and ds[1].reasons["prefill"] == Reason.PREFILL_LOAD


def test_adds_decode_when_itl_breaks():
    planner = Planner(CONFIG, KNOWN)
    o = obs(1, 1, decode_streams=15, itl_mean_s=0.08, ttft_p90_s=0.1, prompt_tokens_per_s=100)
    ds = run(planner, [o, o])
    assert ds[1].targets == {"prefill": 1, "decode": 2}
    assert ds[1].reasons["decode"] == Reason.DECODE_LOAD
    # Learned: 15 streams at 80 ms for a 50 ms SLO is 9.375 a worker, averaged into 10 -- once: the
    # first interval has no interval before it to say the replicas served all of it.
    assert planner.capacity.decode_streams == pytest.approx(0.5 * (10 + 9.375))
    # Few streams (3 of the 10 a worker is thought to hold) at 4x the SLO: the ITL is not the batch's
    # (a KV transfer's gap, a busy host), so nothing is learned; the broken SLO still adds one.
    planner = Planner(CONFIG, KNOWN)
    o = obs(1, 1, decode_streams=3, itl_mean_s=0.2)
    ds = run(planner, [o, o])
    assert ds[1].targets["decode"] == 2 and ds[1].reasons["decode"] == Reason.ITL_SLO
    assert planner.capacity.decode_streams == 10.0
    # Half of it (5 streams) at 4x: that worker holds fewer than it was thought to, and it learns that.
    planner = Planner(CONFIG, KNOWN)
    o = obs(1, 1, decode_streams=5, itl_mean_s=0.2)
    assert run(planner, [o, o])[1].targets["decode"] == 2
    assert planner.capacity.decode_streams == pytest.approx(0.5 * (10 + 1.25))
    # ITL over its SLO with nothing to learn from (the streams ended by the scrape): the model says
    # one suffices, the observation says no.
    planner = Planner(CONFIG, KNOWN)
    o = obs(1, 1, decode_streams=0, itl_mean_s=0.2)
    ds = run(planner, [o, o])
    assert ds[1].targets["decode"] == 2 and ds[1].reasons["decode"] == Reason.ITL_SLO


def test_kv_nearly_full_adds_decode():
    planner = Planner(CONFIG, KNOWN)
    o = obs(1, 1, decode_streams=2, itl_mean_s=0.01, decode_kv_usage=0.95)
    ds = run(planner, [o, o])
    assert ds[1].targets["decode"] == 2 and ds[1].reasons["decode"] == Reason.KV_FULL


def test_gives_replicas_back_one_at_a_time_when_load_falls():
    planner = Planner(CONFIG, KNOWN)
    low = obs(3, 1, prompt_tokens_per_s=300, prefill_tokens_per_s=300, ttft_p90_s=0.1, itl_mean_s=0.01)
    ds = run(planner, [low] * 12)
    # down_after=4 intervals in a row, then one fewer; cooldown 3 s, and the streak starts again.
    assert [d.targets["prefill"] for d in ds] == [3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 1]
    assert ds[3].reasons["prefill"] == Reason.LOAD_FELL and ds[7].reasons["prefill"] == Reason.LOAD_FELL
    assert all(d.targets["decode"] == 1 for d in ds)     # never below 1


def test_no_shrink_while_the_slo_is_tight_or_prompts_queue():
    planner = Planner(CONFIG, KNOWN)
    tight = obs(3, 1, prompt_tokens_per_s=300, ttft_p90_s=0.45)          # under the SLO, not with margin
    queued = obs(3, 1, prompt_tokens_per_s=300, ttft_p90_s=0.1, prefill_waiting=3)
    assert all(d.targets["prefill"] == 3 for d in run(planner, [tight, queued] * 6))


def test_does_not_flap_on_a_noisy_signal_around_a_threshold():
    # One prefill worker carries 800 tok/s at the target utilization: the load alternates around it
    # and the TTFT around its SLO, every other interval over.
    planner = Planner(CONFIG, KNOWN)
    above = obs(1, 1, prompt_tokens_per_s=950, prefill_tokens_per_s=950, ttft_p90_s=0.55, itl_mean_s=0.01)
    below = obs(1, 1, prompt_tokens_per_s=650, prefill_tokens_per_s=650, ttft_p90_s=0.45, itl_mean_s=0.01)
    ds = run(planner, [above, below] * 15)
    assert not any(d.changed for d in ds)
    # From two workers the same signal never lets one go (one would run at ~100% > 60%).
    planner = Planner(CONFIG, KNOWN)
    ds = run(planner, [obs(2, 1, **{k: v for k, v in o.__dict__.items() if k != "replicas"})
                       for o in [above, below] * 15])
    assert not any(d.changed for d in ds)


def test_respects_max_workers_and_min_one():
    config = PlannerConfig(ttft_slo_s=0.5, itl_slo_s=0.05, max_workers=4, up_after=1, cooldown_s=0.0)
    planner = Planner(config, KNOWN)
    o = obs(1, 1, prompt_tokens_per_s=20000, prefill_tokens_per_s=1000, prefill_waiting=50, ttft_p90_s=9.0,
            decode_streams=100, itl_mean_s=0.5)
    ds = run(planner, [o] * 5)
    for d in ds:
        assert sum(d.targets.values()) <= 4 and min(d.targets.values()) >= 1
    # Both want 3 (the most one role may have with 4 in all): the room, 2, is shared.
    assert ds[0].targets == {"prefill": 2, "decode": 2}
    assert ds[0].reasons == {"prefill": Reason.AT_MAX, "decode": Reason.AT_MAX}
    # Prefill wants 3, decode 2 (its ITL over the SLO, no streams to learn from): the larger growth gives.
    o = obs(1, 1, prompt_tokens_per_s=20000, prefill_busy_tokens_per_s=1000, prefill_waiting=50, ttft_p90_s=9.0,
            itl_mean_s=0.5)
    d = Planner(config, KNOWN).decide(o, 0.0)
    assert d.targets == {"prefill": 2, "decode": 2} and d.reasons["decode"] == Reason.ITL_SLO
    idle = run(Planner(config, KNOWN), [obs(1, 1)] * 10)
    assert all(d.targets == {"prefill": 1, "decode": 1} for d in idle)


def test_learns_decode_capacity_only_near_the_itl_slo():
    # 3 streams at 30 ms of a 50 ms SLO: a step's fixed part dominates, 3 x 50 / 30 would say 5
    # streams a worker. Nothing is learned; at 45 ms (90% of the SLO) it is.
    planner = Planner(CONFIG, KNOWN)
    far = obs(1, 1, decode_streams=3, itl_mean_s=0.03)
    run(planner, [far] * 4)
    assert planner.capacity.decode_streams == 10.0
    near = obs(1, 1, decode_streams=8, itl_mean_s=0.045)
    run(planner, [near, near])
    once = 0.5 * (10 + 8 * 0.05 / 0.045)
    assert planner.capacity.decode_streams == pytest.approx(0.5 * (once + 8 * 0.05 / 0.045))   # learned twice


BUDGET = PlannerConfig(ttft_slo_s=0.5, itl_slo_s=0.05, max_workers=4, interval_s=1.0, up_after=2, down_after=6,
                       cooldown_s=3.0)


def test_trades_a_replica_between_roles_at_the_budget():
    # 2:2 of 4. Prompts (700 tok/s) fit one prefill worker at 80% (800) but not at the 60% a
    # shrink for a falling load asks; 25 streams need 4 decode workers at 8 each: the cap leaves 3.
    planner = Planner(BUDGET, KNOWN)
    load = {"prompt_tokens_per_s": 700.0, "prefill_tokens_per_s": 700.0, "ttft_p90_s": 0.45,
            "decode_streams": 25.0, "itl_mean_s": 0.03}
    # (TTFT 450 ms of 500: met, without the margin a shrink for a falling load asks.)
    d0 = planner.decide(obs(2, 2, **load), 0.0)
    assert d0.targets == {"prefill": 2, "decode": 2} and d0.reasons["decode"] == Reason.PENDING
    d1 = planner.decide(obs(2, 2, **load), 1.0)
    # Decode is cut at the cap; prefill gives one at once (not after down_after = 6 intervals).
    assert d1.targets == {"prefill": 1, "decode": 2} and d1.changed
    assert d1.reasons == {"prefill": Reason.REBALANCE, "decode": Reason.AT_MAX}
    # The prefill replica drains (it holds its worker): decode waits for it.
    d2 = planner.decide(obs(1, 2, held={"prefill": 2, "decode": 2}, **load), 2.0)
    assert d2.targets == {"prefill": 1, "decode": 2} and d2.reasons["decode"] == Reason.AT_MAX
    d3 = planner.decide(obs(1, 2, held={"prefill": 1, "decode": 2}, **load), 3.0)
    assert d3.targets == {"prefill": 1, "decode": 3} and d3.reasons["decode"] == Reason.DECODE_LOAD
    # Settled: the same load changes nothing more (prefill at 700 of 800 does not ask back).
    ds = [planner.decide(obs(1, 3, **load), 4.0 + i) for i in range(12)]
    assert not any(d.changed for d in ds)


def test_no_trade_when_the_giver_would_not_carry_its_load():
    # Prompts of 900 tok/s: one prefill worker would run at 90% > 80%. Decode stays cut at the cap.
    planner = Planner(BUDGET, KNOWN)
    load = {"prompt_tokens_per_s": 900.0, "prefill_tokens_per_s": 900.0, "ttft_p90_s": 0.1,
            "decode_streams": 25.0, "itl_mean_s": 0.03}
    ds = run(planner, [obs(2, 2, **load)] * 10)
    assert all(d.targets == {"prefill": 2, "decode": 2} for d in ds)
    assert ds[-1].reasons == {"prefill": Reason.HOLD, "decode": Reason.AT_MAX}


def test_kv_full_of_reservations_for_a_prefill_backlog_adds_no_decode():
    # A decode worker reserves blocks before the prompt is computed: with 40 prompts queued at one
    # prefill worker its pool is full of their reservations, and a second decode worker would not
    # take them any sooner. The prefill backlog is what to grow.
    planner = Planner(CONFIG, KNOWN)
    o = obs(1, 1, decode_streams=2, itl_mean_s=0.01, decode_kv_usage=0.98, prefill_waiting=40)
    ds = run(planner, [o] * 3)
    assert all(d.targets["decode"] == 1 for d in ds)
    assert all(d.reasons["decode"] != Reason.KV_FULL for d in ds)


def test_no_decode_shrink_while_streams_still_rise():
    # Streams building up (a chat load's first minute): low against the capacity, but rising; the
    # same count held steady lets one go after down_after intervals.
    planner = Planner(CONFIG, KNOWN)
    rising = [obs(1, 3, decode_streams=n, itl_mean_s=0.01) for n in (2, 3, 4, 5, 6, 7, 8, 9, 10, 11)]
    assert all(d.targets["decode"] == 3 for d in run(planner, rising))
    steady = run(Planner(CONFIG, KNOWN), [obs(1, 3, decode_streams=5, itl_mean_s=0.01)] * 5)
    assert [d.targets["decode"] for d in steady] == [3, 3, 3, 2, 2]


def test_no_capacity_and_slo_met_is_no_data():
    d = Planner(CONFIG).decide(obs(1, 1, ttft_p90_s=0.1, itl_mean_s=0.01), 0.0)
    assert d.reasons == {"prefill": Reason.NO_DATA, "decode": Reason.NO_DATA} and not d.changed


def test_capacity_from_a_sim_profile(tmp_path):
    profile = json.loads(write_fast_profile(tmp_path / "fast.json").read_text())
    capacity = profile_capacity(profile, itl_slo_s=0.05, context_tokens=1000)
    # Steps of 2 ms + 0.05 ms per sequence + 0.001 ms per context token: (50 - 2) / 1.05 streams.
    assert capacity.decode_streams == pytest.approx(48 / 1.05, rel=1e-3)
    assert capacity.prefill_tokens_per_s == pytest.approx(50000, rel=0.02)


@pytest.mark.parametrize("kw, match", [
    ({"ttft_slo_s": 0.0, "itl_slo_s": 0.05}, "ttft-slo-ms"),
    ({"ttft_slo_s": 1.0, "itl_slo_s": 0.05, "max_workers": 1}, "max-workers"),
    ({"ttft_slo_s": 1.0, "itl_slo_s": 0.05, "interval_s": 0}, "planner-interval-s"),
    ({"ttft_slo_s": 1.0, "itl_slo_s": 0.05, "down_utilization": 0.9}, "down_utilization"),
])
def test_config_refuses(kw, match):
    with pytest.raises(ValueError, match=match):
        PlannerConfig(**kw)


# -- decode load predicted from arrivals (arrivals x expected output x the ITL SLO) -------------------

def test_predicts_decode_load_from_arrivals_before_the_streams_build_up():
    # 400 max_tokens/s arriving, finished requests used half their max_tokens: 200 output tokens/s, at
    # the 50 ms SLO's pace 10 streams; a worker holds 10 at 80%: 2 workers. The streams counted on
    # the worker (1: a load's first seconds) would say 1.
    planner = Planner(CONFIG, KNOWN)
    o = obs(1, 1, max_tokens_per_s=400, finished_output_tokens=50, finished_max_tokens=100, decode_streams=1,
            itl_mean_s=0.01)
    ds = run(planner, [o, o])
    assert planner.output_share == 0.5 and planner.predicted_streams == pytest.approx(10.0)
    assert planner.decode_load == pytest.approx(10.0) and planner.stream_load == 1.0
    assert ds[1].targets["decode"] == 2 and ds[1].reasons["decode"] == Reason.DECODE_LOAD


def test_decode_grows_on_arrivals_before_any_request_finished():
    # A load's first stream life: 400 max_tokens/s arrive, nothing has finished (no share learned),
    # the workers count 1 stream. At a share of 1 (the upper bound) that is 20 streams at the 50 ms
    # SLO's pace; a worker holds 10 at 80%: 3 workers, after up_after = 2 intervals. On the counted
    # streams it would stay at 1 until the streams had built up, a stream life later.
    planner = Planner(CONFIG, KNOWN)
    ds = run(planner, [obs(1, 1, max_tokens_per_s=400, decode_streams=1, itl_mean_s=0.01)] * 2)
    assert [d.targets["decode"] for d in ds] == [1, 3]
    assert [d.reasons["decode"] for d in ds] == [Reason.PENDING, Reason.DECODE_LOAD]
    assert planner.output_share is None and planner.predicted_streams is None
    assert planner.decode_load == pytest.approx(20.0) and planner.upper_streams == pytest.approx(20.0)
    # Once requests finish the share is learned (a quarter here): 5 streams, one worker at 60%
    # carries them, so after down_after = 4 intervals decode gives back one at a time (cooldown 3 s).
    done = obs(1, 3, max_tokens_per_s=400, finished_output_tokens=25, finished_max_tokens=100, decode_streams=1,
               itl_mean_s=0.01)
    ds = run(planner, [done] * 10, start_s=2.0)
    assert planner.output_share == pytest.approx(0.25) and planner.decode_load == pytest.approx(5.0)
    assert [d.targets["decode"] for d in ds] == [3, 3, 3, 2, 2, 2, 2, 1, 1, 1]
    # No arrivals seen (the planner started under a running load): the counted streams still count.
    planner = Planner(CONFIG, KNOWN)
    ds = run(planner, [obs(1, 1, decode_streams=18, itl_mean_s=0.01)] * 2)
    assert planner.decode_load == 18.0 and ds[1].targets["decode"] == 3


def test_decode_gives_back_at_a_phase_change_while_the_old_streams_still_run():
    # Chat -> documents: 18 chat streams still run on 3 workers (10 each at most), but what arrives
    # now is 100 output tokens/s (5 streams at the SLO's pace). Two workers hold the 18 within the
    # SLO and the new load at 60%: one goes after down_after = 4 intervals (counted, 18 > 2 x 10 x
    # 0.6 = 12, it never would). One worker would not hold them: it stays at 2 until they end.
    planner = Planner(CONFIG, KNOWN)
    docs = dict(max_tokens_per_s=100, finished_output_tokens=64, finished_max_tokens=64, itl_mean_s=0.02)
    ds = run(planner, [obs(1, 3, decode_streams=18, **docs)] * 8 + [obs(1, 3, decode_streams=9, **docs)] * 8)
    assert [d.targets["decode"] for d in ds] == [3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1]
    assert ds[3].reasons["decode"] == Reason.LOAD_FELL and ds[11].reasons["decode"] == Reason.LOAD_FELL
    counted = run(Planner(CONFIG, KNOWN), [obs(1, 3, decode_streams=18, itl_mean_s=0.02)] * 8)
    assert all(d.targets["decode"] == 3 for d in counted)


def test_trades_a_decode_replica_to_prefill_on_the_predicted_load():
    # At the budget (4), prompts need 3 prefill workers; decode (3) runs 18 streams, 5 predicted.
    # Two decode workers hold the 18 and carry the 5 at 80%: decode gives one at once. On counted
    # streams (18 > 2 x 10 x 0.8) it would not; nor with 25 running (over 2 workers' 20).
    hot = dict(prompt_tokens_per_s=2500, prefill_tokens_per_s=1000, prefill_busy_tokens_per_s=1000,
               prefill_waiting=10, ttft_p90_s=2.0, itl_mean_s=0.03)
    docs = dict(max_tokens_per_s=100, finished_output_tokens=64, finished_max_tokens=64)
    planner = Planner(BUDGET, KNOWN)
    ds = [planner.decide(obs(1, 3, decode_streams=18, **hot, **docs), float(i)) for i in range(2)]
    assert ds[1].targets == {"prefill": 1, "decode": 2}
    assert ds[1].reasons == {"prefill": Reason.AT_MAX, "decode": Reason.REBALANCE}
    for load in ({"decode_streams": 18}, {"decode_streams": 25, **docs}):
        planner = Planner(BUDGET, KNOWN)
        ds = [planner.decide(obs(1, 3, **hot, **load), float(i)) for i in range(4)]
        assert all(d.targets == {"prefill": 1, "decode": 3} for d in ds)


def test_decode_growth_and_running_guard_read_streams_without_reservations():
    # 30 streams on the decode workers, 20 of them reservations for prompts queued at prefill: two
    # workers hold the 10 decoding, so the predicted 5 lets one of three go.
    planner = Planner(CONFIG, KNOWN)
    docs = dict(max_tokens_per_s=100, finished_output_tokens=64, finished_max_tokens=64, itl_mean_s=0.02)
    ds = run(planner, [obs(1, 3, decode_streams=30, decode_running=10, **docs)] * 4)
    assert ds[3].targets["decode"] == 2 and ds[3].reasons["decode"] == Reason.LOAD_FELL


def test_arrivals_are_averaged_from_the_first_request_not_from_the_idle_start():
    # The planner starts before the traffic: 5 idle intervals, then 400 max_tokens/s (20 streams at a
    # share of 1, nothing finished yet). The average starts at the first arrival, so decode grows to 3
    # after up_after = 2 intervals; averaged with the idle intervals (the 10 s window from 0) the
    # first two would say ~72 max_tokens/s, 3.6 streams: 1 worker.
    planner = Planner(CONFIG, KNOWN)
    load = obs(1, 1, max_tokens_per_s=400, decode_streams=1, itl_mean_s=0.01)
    ds = run(planner, [obs(1, 1)] * 5 + [load] * 2)
    assert [d.targets["decode"] for d in ds] == [1, 1, 1, 1, 1, 1, 3]
    assert planner.asked_load == pytest.approx(400.0)
    # Once it started, an idle interval is averaged in: 2 intervals of 400 and one of 0.
    planner.decide(obs(1, 3), 7.0)
    w = 1 - math.exp(-0.1)
    assert planner.asked_load == pytest.approx(400 * (1 - w) * (1 - (1 - w) ** 2) / (1 - (1 - w) ** 3))


def test_predicted_decode_load_averages_arrivals_over_a_window():
    # A few requests an interval: 0 and 800 max_tokens/s in turn (400 on average, 10 streams). Over
    # the 10 s window the prediction stays within 10% of 10; with the prompt load's weight (half on
    # the newest interval) it would swing between ~6.7 and ~13.3.
    planner, seen = Planner(CONFIG, KNOWN), []
    for i in range(60):
        planner.decide(obs(1, 2, max_tokens_per_s=800 * (i % 2), finished_output_tokens=50, finished_max_tokens=100,
                           decode_streams=10, itl_mean_s=0.02), float(i))
        seen.append(planner.predicted_streams)
    assert 9.0 <= min(seen[40:]) and max(seen[40:]) <= 11.0


def test_prefill_gives_nothing_back_on_idle_intervals_before_the_traffic_or_a_noisy_dip():
    # The planner starts before the traffic (3 idle intervals), then prompts of ~700 tok/s on
    # average arrive a few at a time (the per-interval rates of a chat load: 595 ... 793). One
    # prefill worker would run at 70%, over the 60% a give-back asks: both stay. Counting the idle
    # intervals into the give-back's streak, with the prompt load averaged from 0 at the planner's
    # start, the second went at the first interval of traffic.
    planner = Planner(CONFIG, KNOWN)
    chat = [obs(2, 1, prompt_tokens_per_s=p, prefill_tokens_per_s=p, ttft_p90_s=0.1, itl_mean_s=0.01)
            for p in (595, 791, 198, 396, 791, 793) * 2]
    ds = run(planner, [obs(2, 1)] * 3 + chat)
    assert all(d.targets["prefill"] == 2 for d in ds), [d.targets["prefill"] for d in ds]
    assert planner.prompt_window_load == pytest.approx(594, rel=0.1)


def test_predicted_decode_load_follows_a_fall_in_arrivals_within_three_intervals():
    # 400 max_tokens/s for 20 intervals (20 streams at a share of 1 and the 50 ms SLO), then
    # documents: 20 max_tokens/s. Three intervals that together bring under a third of what the
    # window predicts restart it: 1 stream predicted, where the 10 s window would still say ~15.
    planner = Planner(CONFIG, KNOWN)
    done = dict(finished_output_tokens=100, finished_max_tokens=100, itl_mean_s=0.02)
    for i in range(20):
        planner.decide(obs(1, 3, max_tokens_per_s=400, decode_streams=20, **done), float(i))
    assert planner.predicted_streams == pytest.approx(20.0)
    for i in range(2):
        planner.decide(obs(1, 3, max_tokens_per_s=20, decode_streams=20, **done), 20.0 + i)
    assert planner.predicted_streams > 15.0          # two intervals: not yet
    planner.decide(obs(1, 3, max_tokens_per_s=20, decode_streams=20, **done), 22.0)
    assert planner.predicted_streams == pytest.approx(1.0)
    # It goes on from there as a window: one interval of 400 again moves it by that interval's weight.
    planner.decide(obs(1, 3, max_tokens_per_s=400, decode_streams=20, **done), 23.0)
    assert 1.0 < planner.predicted_streams < 10.0


def test_decode_trades_to_prefill_on_the_running_streams_projected_along_their_fall():
    # At the budget, prompts need more prefill; decode (3 workers of 10 streams) runs chat streams
    # that end at 2 a second (no new ones: documents, 5 streams predicted). A replica given back
    # keeps its streams while it drains, so the two left must hold the streams as they will be a
    # cooldown (3 s) on: the trade comes at 24 running (~18.75 projected), not only once 20 run.
    hot = dict(prompt_tokens_per_s=2500, prefill_tokens_per_s=1000, prefill_busy_tokens_per_s=1000,
               prefill_waiting=10, ttft_p90_s=2.0, itl_mean_s=0.03)
    docs = dict(max_tokens_per_s=100, finished_output_tokens=64, finished_max_tokens=64)
    planner = Planner(BUDGET, KNOWN)
    ds = [planner.decide(obs(1, 3, decode_streams=30 - 2 * i, **hot, **docs), float(i)) for i in range(4)]
    assert [d.targets["decode"] for d in ds] == [3, 3, 3, 2]
    assert ds[3].reasons == {"prefill": Reason.AT_MAX, "decode": Reason.REBALANCE}
    assert planner.running_slope == pytest.approx(-1.75)


def test_prefill_trade_reads_the_prompt_load_over_the_window_not_one_interval():
    # At the budget (2:2) decode's streams need more; prompts arrived at 600 tok/s for 5 intervals,
    # then two of 1100 (a few prompts more by chance). Over the window ~770 tok/s: one prefill
    # worker carries that at 80% (800), and the last intervals' moving average (975) within its
    # full 1000: prefill gives one as soon as decode is cut at the cap. On the moving average alone
    # (975 > 800) it would wait for the noise to pass.
    planner = Planner(BUDGET, KNOWN)
    calm = dict(prefill_tokens_per_s=600, ttft_p90_s=0.3, itl_mean_s=0.03)
    ds = [planner.decide(obs(2, 2, prompt_tokens_per_s=600, decode_streams=5, **calm), float(i)) for i in range(5)]
    ds += [planner.decide(obs(2, 2, prompt_tokens_per_s=1100, decode_streams=40, **calm), 5.0 + i) for i in range(2)]
    assert planner.prompt_load == pytest.approx(975) and planner.prompt_window_load < 800
    assert ds[-1].targets == {"prefill": 1, "decode": 2}
    assert ds[-1].reasons == {"prefill": Reason.REBALANCE, "decode": Reason.AT_MAX}
    # A prompt load rising past full capacity keeps its replica, whatever the window still says.
    planner = Planner(BUDGET, KNOWN)
    ds = [planner.decide(obs(2, 2, prompt_tokens_per_s=600, decode_streams=5, **calm), float(i)) for i in range(5)]
    ds += [planner.decide(obs(2, 2, prompt_tokens_per_s=1400, decode_streams=40, **calm), 5.0 + i) for i in range(2)]
    assert planner.prompt_load > 1000 and ds[-1].targets == {"prefill": 2, "decode": 2}


def test_learns_decode_capacity_above_the_profiles_fixed_step_part(tmp_path):
    # The profile's step has a fixed part (2 ms here, from write_fast_profile); with it known, only
    # the ITL above it grows with the streams: 8 streams a worker at 45 ms of a 50 ms SLO with a
    # 30 ms fixed part hold 8 x 20 / 15 = 10.7 within the SLO, where the proportion says 8 x 50 / 45
    # = 8.9 (which, learned in a phase of few long streams, sank the capacity the give-backs use).
    profile = json.loads(write_fast_profile(tmp_path / "fast.json").read_text())
    assert profile_capacity(profile, itl_slo_s=0.05).decode_base_s == pytest.approx(0.002, rel=0.05)
    planner = Planner(CONFIG, Capacity(prefill_tokens_per_s=1000.0, decode_streams=10.0, decode_base_s=0.03))
    run(planner, [obs(1, 1, decode_streams=8, itl_mean_s=0.045)] * 2)     # the first is not steady
    assert planner.capacity.decode_streams == pytest.approx(0.5 * (10 + 8 * 20 / 15))
    assert planner.capacity.decode_base_s == 0.03
    # Unknown (no profile): proportional, as before.
    planner = Planner(CONFIG, KNOWN)
    run(planner, [obs(1, 1, decode_streams=8, itl_mean_s=0.045)] * 2)
    assert planner.capacity.decode_streams == pytest.approx(0.5 * (10 + 8 * 50 / 45))
