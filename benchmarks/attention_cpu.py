"""Time the CPU paged-attention kernels (cpu_backend) against the torch path (torch_backend).

A script, not a test. Run from the repo root:

    python -m benchmarks.attention_cpu [--threads 1 2] [--dtypes bfloat16 float32] [--quick]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64), block size 16, shuffled
block tables. Each row times both paths side by side in one process with the same thread count
(``torch.set_num_threads``), so their ratio holds even when other work shares the machine;
absolute times do not. The load average is printed before and after.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention import cpu_backend, torch_backend  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM ** -0.5
DECODE_BATCHES = [1, 16, 64]
DECODE_CONTEXTS = [256, 1024]
# name -> (chunk length, context length incl. the chunk) per sequence
PREFILL_CASES = {
    "4x512 fresh": [(512, 512)] * 4,
    "1x512 over 1024 prefix": [(512, 1536)],
}
# --long: where torch's SDPA might overtake the kernel (it did not, up to 4096 tokens)
LONG_PREFILL_CASES = {
    "1x2048 fresh": [(2048, 2048)],
    "1x4096 fresh": [(4096, 4096)],
    "16x64 fresh": [(64, 64)] * 16,
    "4x16 over 512 prefix": [(16, 528)] * 4,
}
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def paged_caches(seq_lens: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """K/V caches (views of one pool) and shuffled block tables holding ``seq_lens`` tokens."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    pool = torch.randn(2, sum(blocks_per_seq), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    block_ids = torch.randperm(sum(blocks_per_seq), dtype=torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for row, n in enumerate(blocks_per_seq):
        tables[row, :n] = block_ids[start:start + n]
        start += n
    return pool[0], pool[1], tables


def time_ms(fn: Callable[[], object], budget_s: float) -> float:
    """Median ms per call over as many calls as fit in ``budget_s`` (at least 3, after a warm-up)."""
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def decode_row(batch: int, context: int, dtype: torch.dtype, budget_s: float) -> tuple[float, ...]:
    k_cache, v_cache, tables = paged_caches([context] * batch, dtype)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    args = (query, k_cache, v_cache, tables, lens, context, SCALE)
    ref = torch_backend.decode_attention(*args)
    out = cpu_backend.decode_attention(*args)
    diff = float((out.double() - ref.double()).norm() / ref.double().norm())
    return (time_ms(lambda: torch_backend.decode_attention(*args), budget_s),
            time_ms(lambda: cpu_backend.decode_attention(*args), budget_s), diff)


def prefill_row(chunks: list[tuple[int, int]], dtype: torch.dtype, budget_s: float) -> tuple[float, ...]:
    q_lens, seq_lens = (list(x) for x in zip(*chunks))
    k_cache, v_cache, tables = paged_caches(seq_lens, dtype)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM).to(dtype)
    starts = (0, *torch.tensor(q_lens).cumsum(0).tolist())
    args = (query, k_cache, v_cache, tables, starts, tuple(seq_lens), SCALE)
    ref = torch_backend.prefill_attention(*args)
    out = cpu_backend.prefill_attention(*args)
    diff = float((out.double() - ref.double()).norm() / ref.double().norm())
    return (time_ms(lambda: torch_backend.prefill_attention(*args), budget_s),
            time_ms(lambda: cpu_backend.prefill_attention(*args), budget_s), diff)


def load_average() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(_DTYPES))
    parser.add_argument("--budget-s", type=float, default=0.3, help="timing budget per path and row")
    parser.add_argument("--quick", action="store_true", help="context 256 and batch <= 16 only")
    parser.add_argument("--long", action="store_true", help="also the longer prefill cases")
    args = parser.parse_args()
    cpu_backend.load_kernels()  # compile outside the timings
    torch.manual_seed(0)
    print(f"# {load_average()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"{'case':<30} {'dtype':<9} {'thr':>3} {'torch ms':>9} {'cpu ms':>9} {'speedup':>8} "
          f"{'rel diff':>9}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype_name in args.dtypes:
            dtype = _DTYPES[dtype_name]
            for context in DECODE_CONTEXTS[:1] if args.quick else DECODE_CONTEXTS:
                for batch in [b for b in DECODE_BATCHES if not args.quick or b <= 16]:
                    t_torch, t_cpu, diff = decode_row(batch, context, dtype, args.budget_s)
                    print(f"{f'decode b={batch} ctx={context}':<30} {dtype_name:<9} {threads:>3} "
                          f"{t_torch:>9.3f} {t_cpu:>9.3f} {t_torch / t_cpu:>7.1f}x {diff:>9.1e}", flush=True)
            cases = {**PREFILL_CASES, **(LONG_PREFILL_CASES if args.long else {})}
            for name, chunks in cases.items():
                t_torch, t_cpu, diff = prefill_row(chunks, dtype, args.budget_s)
                print(f"{'prefill ' + name:<30} {dtype_name:<9} {threads:>3} {t_torch:>9.3f} "
                      f"{t_cpu:>9.3f} {t_torch / t_cpu:>7.1f}x {diff:>9.1e}", flush=True)
    print(f"# {load_average()}")


if __name__ == "__main__":
    main()
