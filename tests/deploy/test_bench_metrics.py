"""deploy.bench.metrics: every summary number against values worked out by hand."""
from __future__ import annotations

import pytest

from deploy.bench.config import SloConfig
from deploy.bench.metrics import latency_stats_ms, request_tpot_s, summarize
from deploy.bench.record import RequestRecord

EXACT = {"rel": 1e-12, "abs": 1e-12}


def _records() -> list[RequestRecord]:
    return [
        # four content chunks, four tokens: TPOT = (0.2 - 0.1) / 3
        RequestRecord("a", prompt_len=10, max_tokens=4, start_s=0.0, ttft_s=0.1, itl_s=[0.02, 0.03, 0.05],
                      e2e_s=0.2, output_len=4, success=True),
        # two chunks carrying three tokens: one ITL gap (per chunk), TPOT = (0.5 - 0.3) / 2
        RequestRecord("b", prompt_len=20, max_tokens=3, start_s=0.5, ttft_s=0.3, itl_s=[0.1],
                      e2e_s=0.5, output_len=3, success=True),
        # one token: no TPOT, no ITL
        RequestRecord("c", prompt_len=5, max_tokens=1, start_s=1.0, ttft_s=0.05, e2e_s=0.05, output_len=1,
                      success=True),
        # failed: counts nowhere but in "failed"
        RequestRecord("d", prompt_len=7, max_tokens=4, start_s=1.5, error="HTTP 500: boom"),
    ]


def test_request_tpot_excludes_the_first_token_and_one_token_requests():
    a, b, c, d = _records()
    assert request_tpot_s(a) == pytest.approx(0.1 / 3, **EXACT)
    assert request_tpot_s(b) == pytest.approx(0.1, **EXACT)
    assert request_tpot_s(c) is None
    assert request_tpot_s(d) is None


def test_summary_matches_hand_computed_values():
    s = summarize(_records(), duration_s=2.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (35, 8)
    assert s["duration_s"] == 2.0
    assert s["request_throughput"] == pytest.approx(1.5, **EXACT)
    assert s["output_throughput"] == pytest.approx(4.0, **EXACT)
    assert s["total_token_throughput"] == pytest.approx(21.5, **EXACT)
    assert s["request_goodput"] is None
    expected = {
        # TTFT ms sorted [50, 100, 300]; p90 at index 1.8 -> 100 + 0.8 * 200; p99 at 1.98
        "ttft": (150.0, 100.0, 260.0, 296.0),
        # TPOT ms [33.33.., 100]; median = mean; p90 at index 0.9
        "tpot": (200 / 3, 200 / 3, 100 / 3 + 0.9 * 200 / 3, 100 / 3 + 0.99 * 200 / 3),
        # ITL ms, per chunk, pooled: [20, 30, 50, 100]; p90 at index 2.7 -> 50 + 0.7 * 50
        "itl": (50.0, 40.0, 85.0, 98.5),
        # E2E ms sorted [50, 200, 500]
        "e2el": (250.0, 200.0, 440.0, 494.0),
    }
    for name, (mean, median, p90, p99) in expected.items():
        got = (s[f"mean_{name}_ms"], s[f"median_{name}_ms"], s[f"p90_{name}_ms"], s[f"p99_{name}_ms"])
        assert got == pytest.approx((mean, median, p90, p99), **EXACT), name
    assert s["std_ttft_ms"] == pytest.approx((((50 - 150) ** 2 + (100 - 150) ** 2 + (300 - 150) ** 2) / 3) ** 0.5,
                                             **EXACT)


@pytest.mark.parametrize(("slo", "goodput"), [
    (SloConfig(ttft_ms=150, tpot_ms=50), 1.0),   # a and c (c's TPOT counts as 0); b's TTFT is 300 ms
    (SloConfig(tpot_ms=50), 1.0),                # a and c; b's TPOT is 100 ms
    (SloConfig(tpot_ms=100), 1.5),               # the bound is inclusive
    (SloConfig(ttft_ms=60), 0.5),                # c only
    (SloConfig(ttft_ms=10), 0.0),
])
def test_goodput_counts_completed_requests_meeting_every_slo(slo, goodput):
    assert summarize(_records(), duration_s=2.0, slo=slo)["request_goodput"] == pytest.approx(goodput, **EXACT)


def test_all_failed_reads_zero_like_vllm():
    s = summarize([_records()[3]], duration_s=1.0, slo=SloConfig(ttft_ms=1))
    assert (s["completed"], s["failed"], s["request_throughput"], s["request_goodput"]) == (0, 1, 0.0, 0.0)
    assert s["mean_ttft_ms"] == s["p99_itl_ms"] == 0.0


def test_latency_stats_keys_and_bad_duration():
    assert list(latency_stats_ms([0.001, 0.003], "x")) == ["mean_x_ms", "median_x_ms", "std_x_ms", "p90_x_ms",
                                                          "p99_x_ms"]
    with pytest.raises(ValueError, match="duration_s must be > 0"):
        summarize([], duration_s=0.0)


def test_chunk_times_and_json_round_trip():
    a = _records()[0]
    a.start_s = 1.0
    assert a.chunk_times_s() == pytest.approx([1.1, 1.12, 1.15, 1.2], **EXACT)
    assert RequestRecord.from_json(a.to_json()) == a
    assert _records()[3].chunk_times_s() == []
