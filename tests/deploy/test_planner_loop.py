"""The planner's I/O (deploy/planner_loop.py): the router's and workers' real metric registries,
scraped over HTTP, turned into observations; decisions applied (or, dry, only logged)."""
from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from deploy.planner import Capacity, Planner, PlannerConfig, Reason
from deploy.planner_loop import PlannerLoop, Scrape, Targets, observe, parse_samples, window_quantile
from router.metrics import RouterMetrics
from worker.metrics import WorkerMetrics
from worker.metrics_server import MetricsServer


def test_window_quantile_of_the_buckets_between_two_scrapes():
    before = {0.1: 10.0, 0.5: 10.0, 1.0: 10.0, float("inf"): 10.0}
    after = {0.1: 10.0, 0.5: 14.0, 1.0: 20.0, float("inf"): 20.0}
    # 10 new observations: 4 in (0.1, 0.5], 6 in (0.5, 1.0]; p90 is the 9th: 5/6 into the second bucket.
    assert window_quantile(before, after, 0.9) == pytest.approx(0.5 + 0.5 * 5 / 6)
    assert window_quantile(before, after, 0.2) == pytest.approx(0.1 + 0.4 * 2 / 4)
    assert window_quantile(after, after, 0.9) is None
    assert window_quantile({}, {0.1: 0.0, float("inf"): 3.0}, 0.5) == 0.1   # all past the last bound


def _scrape(at_s: float, router: RouterMetrics, prefill: list[WorkerMetrics], decode: list[WorkerMetrics]) -> Scrape:
    return Scrape(at_s, parse_samples(router.render().decode()),
                  {role: {f"{role}-{i}": parse_samples(generate_latest(w.registry).decode()) for i, w in enumerate(ws)}
                   for role, ws in (("prefill", prefill), ("decode", decode))})


def test_observe_reads_the_real_series():
    router = RouterMetrics(num_waiting=lambda: 3)
    prefill = [WorkerMetrics("prefill"), WorkerMetrics("prefill")]
    decode = [WorkerMetrics("decode")]
    router.ttft.observe(5.0)                         # before the window: not in it
    before = _scrape(10.0, router, prefill, decode)
    router.prompt_tokens_arrived.inc(4000)
    router.max_tokens_arrived.inc(1000)
    router.generation_tokens.inc(300)                # finished requests: 300 tokens of their 400 max_tokens
    router.max_tokens_finished.inc(400)
    for _ in range(9):
        router.ttft.observe(0.2)                     # (0.1, 0.25]
    router.ttft.observe(0.7)
    router.itl.observe(0.02)
    router.itl.observe(0.006)                        # a 6 ms SLO: p90 read off buckets of 5 and 10 ms would say 9.5
    prefill[0].prompt_tokens.inc(1500)
    prefill[1].prompt_tokens.inc(500)
    prefill[1].waiting.set(2)
    decode[0].running.set(7)
    decode[0].preallocated.set(1)
    decode[0].kv_usage.set(0.4)
    o = observe(before, _scrape(12.0, router, prefill, decode), {"prefill": 2, "decode": 1},
                held={"prefill": 2, "decode": 2})
    assert o.prompt_tokens_per_s == 2000.0 and o.prefill_tokens_per_s == 1000.0
    assert o.prefill_busy_tokens_per_s == 250.0       # the one with a queue
    assert o.prefill_waiting == 2 and o.decode_streams == 8 and o.decode_kv_usage == 0.4
    assert o.decode_running == 7 and o.max_tokens_per_s == 500.0
    assert (o.finished_output_tokens, o.finished_max_tokens) == (300.0, 400.0)
    assert o.ttft_p90_s == pytest.approx(0.25)       # the 9th of 10 is the last in (0.1, 0.25]
    assert o.itl_mean_s == pytest.approx(0.013)      # exact: the histogram's sum and count
    assert o.replicas == {"prefill": 2, "decode": 1} and o.held == {"prefill": 2, "decode": 2}
    assert observe(before, before, {"prefill": 2, "decode": 1}).itl_mean_s is None


@pytest.mark.parametrize("dry_run", [False, True])
def test_loop_scrapes_decides_and_scales(dry_run, caplog):
    router, prefill, decode = RouterMetrics(num_waiting=lambda: 0), WorkerMetrics("prefill"), WorkerMetrics("decode")
    servers = [MetricsServer(m.registry) for m in (router, prefill, decode)]
    router_at, prefill_at, decode_at = (f"127.0.0.1:{s.start('127.0.0.1', 0)}" for s in servers)
    desired = {"prefill": 1, "decode": 1}
    scaled: list[tuple[str, int]] = []

    def scale(role: str, count: int) -> None:
        scaled.append((role, count))
        desired[role] = count

    config = PlannerConfig(ttft_slo_s=0.5, itl_slo_s=0.05, up_after=1, cooldown_s=0.0, dry_run=dry_run)
    loop = PlannerLoop(Planner(config, Capacity(1000.0, 10.0)),
                       lambda: Targets(router_at, {"prefill": [prefill_at], "decode": [decode_at]}, dict(desired),
                                       {"prefill": 1, "decode": 1}),
                       scale)
    try:
        assert loop.tick() is None                   # the first scrape: nothing to compare with
        router.prompt_tokens_arrived.inc(100000)     # far more than one worker's 1000 tok/s, whatever the interval
        router.ttft.observe(3.0)
        prefill.prompt_tokens.inc(1000)
        prefill.waiting.set(20)
        with caplog.at_level(logging.INFO, logger="deploy.planner_loop"):
            decision = loop.tick()
        assert decision is not None and decision.changed
        # 100x what a worker computed in the window: as many as max_workers (8) leaves room for.
        assert decision.reasons["prefill"] == Reason.PREFILL_LOAD and decision.targets["prefill"] == 7
        assert scaled == ([] if dry_run else [("prefill", 7)])
        assert ("dry run, not applied" in caplog.text) == dry_run and "prefill 1 -> 7" in caplog.text
        metrics = parse_samples(generate_latest(loop.metrics.registry).decode())
        assert metrics[("tandem_planner_target_replicas", (("role", "prefill"),))] == 7
        assert metrics[("tandem_planner_reason", (("role", "prefill"),))] == int(Reason.PREFILL_LOAD)
        assert metrics[("tandem_planner_observed_ttft_p90_seconds", ())] == 2.5 + 2.5 * 0.9   # 3 s: in (2.5, 5]
    finally:
        for s in servers:
            s.close()
