"""The simulated engine's latency model: the fit recovers known coefficients, stays
non-negative, and fits the profile measured on this machine (its noise included)."""
from __future__ import annotations

import pytest

from engine.sim.latency import LatencyModel, kv_cache_tokens, load_profile, profile_path
from tests.engine.sim.profiles import KV_BYTES_PER_TOKEN, profile_rows


def test_fit_recovers_the_coefficients_the_rows_were_made_from():
    model = LatencyModel.fit(profile_rows(3.0, 0.5, 0.002, 1000.0))
    assert model.base_ms == pytest.approx(3.0, abs=1e-9)
    assert model.per_seq_ms == pytest.approx(0.5, abs=1e-9)
    assert model.per_context_token_ms == pytest.approx(0.002, abs=1e-12)
    # 1 ms per prefill token measured, in 512-token steps each paying base_ms once
    assert model.per_prefill_token_ms == pytest.approx(1.0 - 3.0 / 512, abs=1e-12)
    assert model.step_ms(4, 4 * 100, 0) == pytest.approx(3.0 + 2.0 + 0.8)
    assert model.step_ms(2, 300, 64) == pytest.approx(3.0 + 1.0 + 0.6 + 64 * (1.0 - 3.0 / 512))
    assert model.step_ms(0, 0, 0) == 0.0


def test_fit_never_gives_a_negative_coefficient():
    profile = profile_rows(10.0, 0.0, 0.0, 1000.0)
    for row in profile["decode"]:   # bigger batches measured faster: least squares would go negative
        row["step_ms"] = 20.0 - 0.1 * row["batch"]
    model = LatencyModel.fit(profile)
    assert model.per_seq_ms == 0.0 and model.per_context_token_ms == 0.0
    assert model.base_ms == pytest.approx(sum(r["step_ms"] for r in profile["decode"]) / 6)


def test_the_profile_measured_here_is_fitted_within_fifteen_percent():
    profile = load_profile("smollm2-135m-cpu-2core")
    model = LatencyModel.fit(profile)
    for row in profile["decode"]:
        predicted = model.step_ms(row["batch"], row["batch"] * row["context"], 0)
        assert predicted == pytest.approx(row["step_ms"], rel=0.15), row   # its batch-1 rows: 23.9, 20.4 ms
    prefill = profile["prefill"][0]
    assert model.step_ms(0, 0, 512) == pytest.approx(512e3 / prefill["tok_per_s"], rel=1e-9)
    assert kv_cache_tokens(profile, None) == (1 << 30) // 46080


def test_gpu_profile_cites_its_source_and_fits():
    profile = load_profile("llama-3.1-8b-h100")
    assert "docs.nvidia.com/nim" in profile["source"] and "ESTIMATE" in profile["source"]
    model = LatencyModel.fit(profile)
    assert 3.0 < model.step_ms(1, 1000, 0) < 6.0        # NIM: ITL 4.63 ms at concurrency 1
    assert 10.0 < model.step_ms(200, 200_000, 0) < 16.0  # NIM: ITL 12.65 ms at concurrency 200
    assert kv_cache_tokens(profile, None) == 400000
    assert kv_cache_tokens(profile, 1 << 30) == (1 << 30) // 131072


def test_measured_gpu_profile_says_how_it_was_made_and_fits():
    profile = load_profile("llama-3.1-8b-h200")
    assert profile["source"].startswith("MEASURED") and "--load-format dummy" in profile["source"]
    assert {r["context"] for r in profile["decode"]} == {1024, 4096}   # two contexts: batch and context separate
    # Every row also holds the GPU's kernel time, below the host-bound wall time it was measured with.
    assert all(0 < r["gpu_ms"] < r["step_ms"] for r in profile["decode"])
    model = LatencyModel.fit(profile)
    assert 20.0 < model.step_ms(1, 1024, 0) < 45.0       # measured: 27.7 ms (batch 1, 1,024 tokens)
    assert model.step_ms(128, 128 * 4096, 0) > model.step_ms(1, 4096, 0)
    assert kv_cache_tokens(profile, None) == profile["kv_cache_tokens"] > 400000


def test_bad_profiles_are_refused_with_a_reason(tmp_path):
    with pytest.raises(ValueError, match="'decode' and 'prefill' rows"):
        LatencyModel.fit({"decode": []})
    with pytest.raises(ValueError, match="tok_per_s > 0"):
        LatencyModel.fit({**profile_rows(1, 1, 0, 1000.0), "prefill": [{"dtype": "float32", "threads": 2,
                                                                        "tok_per_s": 0}]})
    with pytest.raises(FileNotFoundError, match="llama-3.1-8b-h100"):
        profile_path(str(tmp_path / "missing.json"))
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="JSON object"):
        load_profile(str(tmp_path / "list.json"))
    assert kv_cache_tokens(profile_rows(1, 1, 0, 1.0), 10 * KV_BYTES_PER_TOKEN) == 10
