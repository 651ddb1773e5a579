"""Profiles for the simulated-engine tests: ``benchmarks/engine.py --json`` rows made from known
coefficients, so a fit can be checked exactly and a test deployment steps fast."""
from __future__ import annotations

import json
from pathlib import Path

KV_BYTES_PER_TOKEN = 46080   # SmolLM2-135M float32, as the measured profile says


def profile_rows(base_ms: float, per_seq_ms: float, per_context_token_ms: float, prefill_tok_per_s: float,
                 kv_cache_tokens: int | None = None) -> dict:
    decode = [{"dtype": "float32", "batch": b, "context": c, "threads": 2,
               "step_ms": base_ms + per_seq_ms * b + per_context_token_ms * b * c, "tok_per_s": 0.0}
              for b in (1, 8, 32) for c in (128, 512)]
    profile = {"source": "tests/engine/sim/profiles.py", "copy_gbps": 1.0, "decode": decode,
               "prefill": [{"dtype": "float32", "threads": 2, "tok_per_s": prefill_tok_per_s,
                            "kv_bytes_per_token": KV_BYTES_PER_TOKEN}],
               "profiles": {}, "model": "smollm2-135m-instruct", "device": "cpu", "prefill_len": 512,
               "prefill_batch": 2, "chunked_prefill_size": 512}
    if kv_cache_tokens is not None:
        profile["kv_cache_tokens"] = kv_cache_tokens
    return profile


def write_fast_profile(path: Path) -> Path:
    """Steps of a few ms: 2 ms + 0.05 ms per sequence + 1 ms per 1000 context tokens; 50k
    prefill tokens/s."""
    path.write_text(json.dumps(profile_rows(2.0, 0.05, 0.001, 50000.0, kv_cache_tokens=4096)))
    return path
