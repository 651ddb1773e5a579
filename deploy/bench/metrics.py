"""Serving metrics from recorded requests, defined exactly as `vllm bench serve` defines them.

Pure functions (no clock, no I/O), run in the `tandem bench` process after the load ends.

- TTFT: first content chunk's arrival - send time.
- TPOT, per request with more than one output token: (e2e - ttft) / (output_len - 1), so the
  first token is not counted twice; one-token requests have no TPOT.
- ITL: every gap between consecutive content chunks, pooled over requests (per chunk, not per
  token: a chunk carrying several tokens is one gap).
- E2E latency: last stream event's arrival - send time.
- Throughputs divide by the benchmark's wall duration: completed requests, output tokens, and
  prompt + output tokens of completed requests.
- Goodput (DistServe): completed requests meeting every given SLO, per second. As in vLLM, a
  one-token request's TPOT counts as 0 against the TPOT SLO.
Percentiles are numpy.percentile's default (linear interpolation); an empty list reads 0.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deploy.bench.config import SloConfig
from deploy.bench.record import RequestRecord

PERCENTILES = (90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def request_tpot_s(record: RequestRecord) -> float | None:
    if not record.success or record.output_len <= 1:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_len - 1)


def latency_stats_ms(values_s: Sequence[float], name: str) -> dict[str, float]:
    """mean/median/std/p90/p99 of ``values_s`` in milliseconds, keyed as vLLM keys them."""
    data = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    stats = {f"mean_{name}_ms": float(np.mean(data)), f"median_{name}_ms": float(np.median(data)),
             f"std_{name}_ms": float(np.std(data))}
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = float(np.percentile(data, p))
    return stats


def meets_slo(record: RequestRecord, slo: SloConfig) -> bool:
    if not record.success:
        return False
    if slo.ttft_ms is not None and record.ttft_s * 1000.0 > slo.ttft_ms:
        return False
    tpot_s = request_tpot_s(record) or 0.0
    return slo.tpot_ms is None or tpot_s * 1000.0 <= slo.tpot_ms


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SloConfig | None = None) -> dict:
    """Every summary number of one run, as a flat JSON-able dict (goodput None without SLOs)."""
    slo = slo or SloConfig()
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    tpots = [t for t in map(request_tpot_s, done) if t is not None]
    summary = {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "request_goodput": (sum(meets_slo(r, slo) for r in done) / duration_s) if slo.is_set else None,
    }
    summary.update(latency_stats_ms([r.ttft_s for r in done], "ttft"))
    summary.update(latency_stats_ms(tpots, "tpot"))
    summary.update(latency_stats_ms([gap for r in done for gap in r.itl_s], "itl"))
    summary.update(latency_stats_ms([r.e2e_s for r in done], "e2el"))
    return summary
