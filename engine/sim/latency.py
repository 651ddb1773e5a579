"""The simulated engine's step-time model and its profiles (pure Python, no torch).

Runs wherever a simulated engine is built (a worker's engine thread, ``LLM``), and in tests.

A profile is the JSON ``benchmarks/engine.py --json`` prints: ``decode`` rows (``batch``,
``context``, ``step_ms``, ``dtype``, ``threads``) and ``prefill`` rows (``tok_per_s``,
``kv_bytes_per_token``, ``dtype``, ``threads``), plus the run's ``prefill_len``,
``prefill_batch`` and ``chunked_prefill_size``. Optional fields the simulator reads:
``kv_cache_tokens`` (the KV pool a worker of that hardware holds; default: the CPU default of
1 GiB over ``kv_bytes_per_token``), ``tokenizer`` (a built-in model or local path whose
tokenizer and vocabulary the simulated worker serves; default: the built-in model), ``source``.

The model of one step, in ms::

    step_ms = base_ms + per_seq_ms * num_decode_seqs
              + per_context_token_ms * num_decode_context_tokens
              + per_prefill_token_ms * num_prefill_tokens

``base_ms``, ``per_seq_ms`` and ``per_context_token_ms`` are the non-negative least-squares fit
of the decode rows (``num_decode_context_tokens`` = batch x context); ``per_prefill_token_ms`` is
what a prefill row's ms per token leaves once the fitted ``base_ms`` of each of its steps is
taken out. Rows of one dtype (the first decode row's) and its largest thread count are used.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import DEFAULT_CPU_KV_CACHE_BYTES

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
MAX_PROFILE_BYTES = 1 << 20


@dataclass(frozen=True)
class LatencyModel:
    """Step time = a linear function of what the step computes (module docstring)."""

    base_ms: float
    per_seq_ms: float
    per_context_token_ms: float
    per_prefill_token_ms: float

    def __post_init__(self) -> None:
        for name in ("base_ms", "per_seq_ms", "per_context_token_ms", "per_prefill_token_ms"):
            if not getattr(self, name) >= 0.0:   # NaN fails too
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")

    def step_ms(self, num_decode_seqs: int, num_decode_context_tokens: int, num_prefill_tokens: int) -> float:
        if not (num_decode_seqs or num_prefill_tokens):
            return 0.0
        return (self.base_ms + self.per_seq_ms * num_decode_seqs
                + self.per_context_token_ms * num_decode_context_tokens
                + self.per_prefill_token_ms * num_prefill_tokens)

    @classmethod
    def fit(cls, profile: dict[str, Any]) -> LatencyModel:
        decode, prefill = _selected_rows(profile)
        features: list[tuple[float, ...]] = [(1.0, float(r["batch"]), float(r["batch"] * r["context"])) for r in decode]
        base, per_seq, per_context = _nonnegative_least_squares(features, [float(r["step_ms"]) for r in decode])
        ms_per_token = sum(1e3 / float(r["tok_per_s"]) for r in prefill) / len(prefill)
        per_prefill = max(ms_per_token - base / _prefill_tokens_per_step(profile), 0.0)
        return cls(base, per_seq, per_context, per_prefill)


def _selected_rows(profile: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    decode_all, prefill_all = profile.get("decode") or [], profile.get("prefill") or []
    if not decode_all or not prefill_all:
        raise ValueError("a simulator profile needs 'decode' and 'prefill' rows (benchmarks/engine.py --json)")
    dtype = decode_all[0].get("dtype")
    decode = [r for r in decode_all if r.get("dtype") == dtype]
    threads = max(r.get("threads", 0) for r in decode)
    decode = [r for r in decode if r.get("threads", 0) == threads]
    prefill = [r for r in prefill_all if r.get("dtype") == dtype]
    prefill = [r for r in prefill if r.get("threads", 0) == threads] or prefill
    if not prefill:
        raise ValueError(f"the profile has decode rows for dtype {dtype!r} but no prefill row for it")
    for row in decode:
        if not (row["batch"] >= 1 and row["context"] >= 0 and row["step_ms"] > 0):
            raise ValueError(f"a decode row needs batch >= 1, context >= 0, step_ms > 0: {row}")
    for row in prefill:
        if not row["tok_per_s"] > 0:
            raise ValueError(f"a prefill row needs tok_per_s > 0: {row}")
    return decode, prefill


def _prefill_tokens_per_step(profile: dict[str, Any]) -> int:
    """Tokens in each step of the prefill measurement: its prompts, cut into chunks."""
    total = int(profile.get("prefill_len", 512)) * int(profile.get("prefill_batch", 1))
    return max(min(total, int(profile.get("chunked_prefill_size") or total)), 1)


def _nonnegative_least_squares(rows: list[tuple[float, ...]], targets: list[float]) -> tuple[float, ...]:
    """min ||A x - b|| with x >= 0, by trying every subset of free coefficients (3 here, so 7
    small solves): the best solution whose coefficients are all >= 0 wins."""
    width = len(rows[0])
    best: tuple[float, tuple[float, ...]] | None = None
    for size in range(1, width + 1):
        for free in itertools.combinations(range(width), size):
            solved = _least_squares([tuple(r[i] for i in free) for r in rows], targets)
            if solved is None or min(solved) < 0:
                continue
            x = [0.0] * width
            for i, value in zip(free, solved):
                x[i] = value
            residual = sum((sum(a * c for a, c in zip(r, x)) - t) ** 2 for r, t in zip(rows, targets))
            if best is None or residual < best[0] - 1e-12:
                best = (residual, tuple(x))
    if best is None:
        raise ValueError("cannot fit the decode rows with non-negative coefficients")
    return best[1]


def _least_squares(rows: list[tuple[float, ...]], targets: list[float]) -> list[float] | None:
    """Normal equations solved by Gaussian elimination; None when they are singular (e.g. all
    rows share one context, so batch and batch x context cannot be told apart)."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * t for r, t in zip(rows, targets))]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(a[k][col]))
        if abs(a[pivot][col]) < 1e-9 * max(1.0, max(abs(v) for v in a[pivot][:n])):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for k in range(n):
            if k != col:
                factor = a[k][col] / a[col][col]
                a[k] = [v - factor * p for v, p in zip(a[k], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def profile_path(name: str) -> Path:
    """A profile file: a path, else the name of a shipped one (``profiles/<name>.json``)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path.resolve()
    shipped = PROFILES_DIR / f"{name}.json"
    if "/" not in name and shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
    raise FileNotFoundError(f"simulator profile {name!r} not found: give a JSON file written by "
                            f"benchmarks/engine.py --json, or one of the shipped profiles ({names})")


def load_profile(name: str) -> dict[str, Any]:
    path = profile_path(name)
    if path.stat().st_size > MAX_PROFILE_BYTES:
        raise ValueError(f"{path}: a simulator profile is at most {MAX_PROFILE_BYTES} bytes")
    try:
        profile = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(profile, dict):
        raise ValueError(f"{path}: a simulator profile is a JSON object")
    return profile


def kv_bytes_per_token(profile: dict[str, Any]) -> int:
    """What one token's KV costs on the profiled engine (its first prefill row's)."""
    rows = [r for r in profile.get("prefill") or [] if r.get("kv_bytes_per_token")]
    if not rows:
        raise ValueError("the profile has no prefill row with kv_bytes_per_token: rerun benchmarks/engine.py "
                         "--json, or set kv_cache_tokens in it")
    return int(rows[0]["kv_bytes_per_token"])


def kv_cache_tokens(profile: dict[str, Any], kv_cache_memory: int | None) -> int:
    """Tokens the simulated pool holds: ``kv_cache_memory`` bytes of the profiled engine's KV
    when given, else the profile's ``kv_cache_tokens``, else the CPU default pool's."""
    if kv_cache_memory is not None:
        return kv_cache_memory // kv_bytes_per_token(profile)
    if profile.get("kv_cache_tokens"):
        return int(profile["kv_cache_tokens"])
    return DEFAULT_CPU_KV_CACHE_BYTES // kv_bytes_per_token(profile)
