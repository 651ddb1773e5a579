"""Time the Triton paged-attention kernels against the torch path on CUDA.

A script, not a test. Run from the repo root on a machine with a GPU:

    python -m benchmarks.attention_gpu [--model llama8b] [--dtype bfloat16] [--skip-torch]

Each row is one shape: the median time of each path (``triton.testing.do_bench``), the
Triton/torch speedup and the relative error ||out - ref|| / ||ref|| of each path against the
torch path run in float64 on the same (upcast) inputs. Decode rows report the achieved
bandwidth over the K/V bytes the batch must read; prefill rows report TFLOP/s over the causal
score and value products actually needed (2 * 2 * head_dim FLOPs per visible query-key pair
and head) and, where every chunk starts at position 0, the time of dense causal
``scaled_dot_product_attention`` on contiguous K/V (no paging) as a yardstick.
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
    run_float64: Callable[[], torch.Tensor]
    work: float  # bytes (decode) or FLOPs (prefill)
    run_dense: Callable[[], torch.Tensor] | None = None


def _float64(args: tuple) -> tuple:
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


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
    args64 = _float64(args)
    return Workload(lambda: triton_backend.decode_attention(*args),
                    lambda: torch_backend.decode_attention(*args),
                    lambda: torch_backend.decode_attention(*args64), nbytes)


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
    args64 = _float64(args)
    dense = None
    if all(q == s for q, s in chunks) and len(set(q_lens)) == 1:
        # the same attention on contiguous [batch, heads, len, head_dim] tensors, K/V repeated
        # per query head group (what flash kernels read for GQA), no block table
        shape_q = (len(q_lens), q_lens[0], shape.num_heads, shape.head_dim)
        q4 = query.view(shape_q).transpose(1, 2).contiguous()
        k4 = torch.randn_like(q4)
        v4 = torch.randn_like(q4)
        dense = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True,  # noqa: E731
                                                                         scale=scale)
    return Workload(lambda: triton_backend.prefill_attention(*args),
                    lambda: torch_backend.prefill_attention(*args),
                    lambda: torch_backend.prefill_attention(*args64), flops, dense)


@dataclass
class Measured:
    triton_ms: float
    torch_ms: float | None       # None when skipped
    triton_err: float            # against the float64 reference
    torch_err: float | None
    dense_ms: float | None = None


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def _measure(workload: Workload, skip_torch: bool) -> Measured:
    from triton.testing import do_bench

    ref = workload.run_float64()
    triton_ms = do_bench(workload.run_triton, return_mode="median")
    triton_err = _rel_err(workload.run_triton(), ref)
    dense_ms = None if workload.run_dense is None else do_bench(workload.run_dense, return_mode="median")
    if skip_torch:
        return Measured(triton_ms, None, triton_err, None, dense_ms)
    torch_ms = do_bench(workload.run_torch, return_mode="median")
    return Measured(triton_ms, torch_ms, triton_err, _rel_err(workload.run_torch(), ref), dense_ms)


def _row(label: str, m: Measured, rate: str) -> str:
    def col(value: float | None, fmt: str, width: int) -> str:
        return format(value, fmt) if value is not None else f"{'-':>{width}}"
    speedup = f"{m.torch_ms / m.triton_ms:7.1f}x" if m.torch_ms is not None else f"{'-':>8}"
    return (f"{label:<28}{m.triton_ms:10.3f}{col(m.torch_ms, '9.3f', 9)}{speedup}"
            f"{m.triton_err:10.1e}{col(m.torch_err, '10.1e', 10)}{col(m.dense_ms, '9.3f', 9)}  {rate}")


def _warm_up_gpu(seconds: float = 1.0) -> None:
    """Keep the GPU busy for a while first, so the first rows are not timed at idle clocks."""
    import time
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


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
    _warm_up_gpu()
    header = (f"{'shape':<28}{'triton ms':>10}{'torch ms':>9}{'speedup':>8}{'err triton':>10}"
              f"{'err torch':>10}{'dense ms':>9}  rate")
    import triton
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"dtype: {args.dtype}  block_size: {args.block_size}  (err: relative to float64)")
    for name, shape in MODELS.items():
        if args.model not in ("all", name):
            continue
        print(f"\n== {name}: {shape.num_heads} heads, {shape.num_kv_heads} kv heads, "
              f"head_dim {shape.head_dim}\n-- decode\n{header}")
        for batch in DECODE_BATCHES:
            for context in DECODE_CONTEXTS:
                workload = decode_workload(shape, batch, context, args.block_size, dtype)
                m = _measure(workload, args.skip_torch)
                rate = f"{workload.work / m.triton_ms / 1e6:8.1f} GB/s"
                print(_row(f"batch {batch} x ctx {context}", m, rate), flush=True)
                del workload
        print(f"-- prefill\n{header}")
        for label, chunks in PREFILL_BATCHES.items():
            workload = prefill_workload(shape, chunks, args.block_size, dtype)
            m = _measure(workload, args.skip_torch)
            rate = f"{workload.work / m.triton_ms / 1e9:8.1f} TFLOP/s"
            print(_row(label, m, rate), flush=True)
            del workload
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
