"""Time the Triton paged-attention kernels against the torch path on CUDA.

A script, not a test. Run from the repo root on a machine with a GPU:

    python -m benchmarks.attention_gpu [--model llama8b] [--dtype bfloat16] [--skip-torch]

Each row is one shape: the median time of each path (``triton.testing.do_bench``), the
Triton/torch speedup and the relative difference of their outputs. Decode rows report the
achieved bandwidth over the K/V bytes the batch must read; prefill rows report TFLOP/s over the
causal score and value products actually needed (2 * 2 * head_dim FLOPs per visible
query-key pair and head).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention import torch_backend, triton_backend  # noqa: E402


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


MODELS = {
    "smollm2": Shape(num_heads=9, num_kv_heads=3, head_dim=64),
    "llama8b": Shape(num_heads=32, num_kv_heads=8, head_dim=128),
}
DECODE_BATCHES = [1, 8, 32, 64]
DECODE_CONTEXTS = [512, 2048, 4096]
# (chunk length, context length incl. the chunk) per sequence of one prefill batch
PREFILL_BATCHES = {
    "1x1024": [(1024, 1024)],
    "1x4096": [(4096, 4096)],
    "4x512+3584 prefix": [(512, 4096)] * 4,
    "16x128": [(128, 128)] * 16,
}


@dataclass
class Workload:
    run_triton: Callable[[], torch.Tensor]
    run_torch: Callable[[], torch.Tensor]
    work: float  # bytes (decode) or FLOPs (prefill)


def _paged_caches(seq_lens: list[int], shape: Shape, block_size: int, dtype: torch.dtype,
                  device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches (views of one pool) and shuffled block tables holding ``seq_lens`` tokens."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    pool = torch.randn(2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim,
                       device=device).to(dtype)
    block_ids = torch.randperm(num_blocks, device=device).to(torch.int32)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
    start = 0
    for row, n in enumerate(blocks_per_seq):
        tables[row, :n] = block_ids[start:start + n]
        start += n
    return pool[0], pool[1], tables


def decode_workload(shape: Shape, batch: int, context: int, block_size: int, dtype: torch.dtype,
                    device: str = "cuda") -> Workload:
    seq_lens = [context] * batch
    k_cache, v_cache, tables = _paged_caches(seq_lens, shape, block_size, dtype, device)
    query = torch.randn(batch, shape.num_heads, shape.head_dim, device=device).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = shape.head_dim ** -0.5
    args = (query, k_cache, v_cache, tables, lens, context, scale)
    nbytes = 2 * sum(seq_lens) * shape.num_kv_heads * shape.head_dim * k_cache.element_size()
    return Workload(lambda: triton_backend.decode_attention(*args),
                    lambda: torch_backend.decode_attention(*args), nbytes)


def prefill_workload(shape: Shape, chunks: list[tuple[int, int]], block_size: int,
                     dtype: torch.dtype, device: str = "cuda") -> Workload:
    q_lens, seq_lens = (list(x) for x in zip(*chunks))
    k_cache, v_cache, tables = _paged_caches(seq_lens, shape, block_size, dtype, device)
    query = torch.randn(sum(q_lens), shape.num_heads, shape.head_dim, device=device).to(dtype)
    query_start_loc = (0, *torch.tensor(q_lens).cumsum(0).tolist())
    scale = shape.head_dim ** -0.5
    args = (query, k_cache, v_cache, tables, query_start_loc, tuple(seq_lens), scale)
    # query i of a chunk of length L in a context of S sees S - L + i + 1 keys
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in chunks)
    flops = 4.0 * pairs * shape.num_heads * shape.head_dim
    return Workload(lambda: triton_backend.prefill_attention(*args),
                    lambda: torch_backend.prefill_attention(*args), flops)


def _measure(workload: Workload, skip_torch: bool) -> tuple[float, float | None, float | None]:
    """Median ms of Triton, of torch (None when skipped), and their relative difference."""
    from triton.testing import do_bench

    triton_ms = do_bench(workload.run_triton, return_mode="median")
    if skip_torch:
        return triton_ms, None, None
    torch_ms = do_bench(workload.run_torch, return_mode="median")
    out, ref = workload.run_triton().double(), workload.run_torch().double()
    return triton_ms, torch_ms, float((out - ref).norm() / ref.norm())


def _row(label: str, triton_ms: float, torch_ms: float | None, err: float | None,
         rate: str) -> str:
    torch_col = f"{torch_ms:9.3f}" if torch_ms is not None else f"{'-':>9}"
    speedup = f"{torch_ms / triton_ms:7.1f}x" if torch_ms is not None else f"{'-':>8}"
    err_col = f"{err:9.1e}" if err is not None else f"{'-':>9}"
    return f"{label:<28}{triton_ms:10.3f}{torch_col}{speedup}{err_col}  {rate}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--skip-torch", action="store_true", help="time only the Triton kernels")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_gpu: no CUDA device here; this benchmark times GPU kernels. "
                 "The CPU checks are `pytest tests/engine/attention`.")
    dtype = getattr(torch, args.dtype)
    header = f"{'shape':<28}{'triton ms':>10}{'torch ms':>9}{'speedup':>8}{'rel diff':>9}  rate"
    print(f"device: {torch.cuda.get_device_name()}  dtype: {args.dtype}  "
          f"block_size: {args.block_size}")
    for name, shape in MODELS.items():
        if args.model not in ("all", name):
            continue
        print(f"\n== {name}: {shape.num_heads} heads, {shape.num_kv_heads} kv heads, "
              f"head_dim {shape.head_dim}\n-- decode\n{header}")
        for batch in DECODE_BATCHES:
            for context in DECODE_CONTEXTS:
                workload = decode_workload(shape, batch, context, args.block_size, dtype)
                triton_ms, torch_ms, err = _measure(workload, args.skip_torch)
                rate = f"{workload.work / triton_ms / 1e6:8.1f} GB/s"
                print(_row(f"batch {batch} x ctx {context}", triton_ms, torch_ms, err, rate))
                del workload
        print(f"-- prefill\n{header}")
        for label, chunks in PREFILL_BATCHES.items():
            workload = prefill_workload(shape, chunks, args.block_size, dtype)
            triton_ms, torch_ms, err = _measure(workload, args.skip_torch)
            rate = f"{workload.work / triton_ms / 1e9:8.1f} TFLOP/s"
            print(_row(label, triton_ms, torch_ms, err, rate))
            del workload
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
