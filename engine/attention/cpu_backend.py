"""Paged attention on the CPU with C kernels that read K/V where they lie in the paged pool.

Runs inside a worker's engine thread. The functions take the same arguments and keep the same
cache layout as ``engine.attention.torch_backend``: caches are per layer ``[num_blocks,
block_size, num_kv_heads, head_dim]`` and a sequence's token at position p lives in block
``block_table[p // block_size]`` at offset ``p % block_size``. The torch path gathers (copies)
every context out of the pool per layer before SDPA; these kernels walk the block table instead,
one sequence's KV heads (decode, with sequences enough for every thread) or one (sequence, KV
head) per OpenMP work item, with an online softmax in float32. Decode can split a context longer
than ``partition_tokens`` into partitions of that many keys, separate work items merged by
log-sum-exp (flash-decoding), so a long document among short chats, or alone, keeps both threads
busy; off by default (``DECODE_PARTITION_TOKENS``) until measured to help.

Queries and caches may be float32 or bfloat16; other dtypes take the torch path. Kernels use
``torch.get_num_threads()`` threads, and results do not depend on the thread count. On CPUs with
AMX, bfloat16 prefill runs on the AMX tiles (``tandem_paged_prefill_amx``: scores as K Q^T, 16
queries of a head per work item, online softmax across the lanes) where head_dim is a multiple
of 32 up to 256 and block_size a multiple of 16. On 2 AMX cores, SmolLM2's 9/3 heads, ms of AMX /
AVX-512 kernel / torch SDPA (which gathers the context first): one 256-token prompt 0.28 / 0.61 /
0.42, 512: 0.78 / 2.21 / 1.20, 1024: 2.42 / 8.23 / 3.10, 2048: 7.82 / 31.7 / 9.98, a 512-token chunk
over a 2048-token context 3.70 / 13.9 / 5.92, 8 x 128: 0.88 / 1.53 / 1.33, 8 x 64: 0.39 / 0.52 /
0.83, 16 x 32: 0.41 / 0.41 / 1.25 (2026-11-27, /tmp script against the float64 torch path, the
three kernels' errors equal). Since 2026-11-28 the AMX kernel gathers V^T, rescales lazily and
masks only diagonal steps: 1024: 2.1-2.2 -> 1.7, 2048: 6.8-7.3 -> 5.5-5.8, the 512-token chunk over
2048: 3.2-3.5 -> 2.3-2.4 (alternated with the earlier kernel in one session); session 26's
cheaper softmax (docs/performance.md): 2048: 6.0 -> 5.2, the 512-token chunk 2.6 -> 2.1. Other AMX shapes
keep the earlier rule: SDPA for bfloat16 chunks of at least ``SDPA_MIN_CHUNK`` tokens, the AVX-512
kernel below that. Without AMX the AVX-512 kernel was 1.8-3.8x faster than SDPA on every case
tried, 16-token chunks over a prefix up to one 4096-token fresh prompt (``python -m
benchmarks.attention_cpu --long``).

``python -m engine.attention.cpu_backend --build`` compiles the kernels ahead of time.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from collections.abc import Sequence

import torch

from engine import native
from engine.attention import cpu_kernels, torch_backend
from engine.config import cpu_flags
from engine.native import KernelBuildError

__all__ = ["KernelBuildError", "decode_attention", "load_kernels", "prefill_attention", "write_kv"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
SDPA_MIN_CHUNK = 128   # on AMX CPUs, bfloat16 chunks this long that the AMX kernel cannot run take SDPA
# > 0: decode splits longer contexts into partitions of this many keys; 0 (off) until a quiet
# A/B shows a gain (docs/performance.md, 2026-11-27)
DECODE_PARTITION_TOKENS = 0
_AMX = "amx_bf16" in cpu_flags()

# index_copy_ into the pool is a plain scatter of a few rows: nothing to gain in C.
write_kv = torch_backend.write_kv


def load_kernels() -> ctypes.CDLL:
    """The compiled kernels; raises :class:`KernelBuildError` when they cannot be built here."""
    return cpu_kernels.load()


def _supported(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (query.dtype in _DTYPE_CODES and k_cache.dtype in _DTYPE_CODES
            and v_cache.dtype == k_cache.dtype and query.device.type == "cpu")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dimension, which is all the kernels need."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _int32(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32, device="cpu").contiguous()


def _check_shapes(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, num_seqs: int, num_query_rows: int) -> None:
    """What the kernels trust: the C code indexes raw pointers with these sizes."""
    if v_cache.shape != k_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both "
                         "be [num_blocks, block_size, num_kv_heads, head_dim]")
    if query.dim() != 3 or query.shape[2] != k_cache.shape[3] or query.shape[0] != num_query_rows:
        raise ValueError(f"query {tuple(query.shape)} must be [{num_query_rows}, num_heads, "
                         f"{k_cache.shape[3]}]")
    if block_tables.dim() != 2 or block_tables.shape[0] < num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} needs a row per sequence ({num_seqs})")


def _run(fn, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
         block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None,
         scale: float, *extra: int) -> torch.Tensor:
    """Call one kernel; ``query_start_loc`` is None for decode (one query row per sequence);
    ``extra`` follows the thread count (decode: the partition length)."""
    num_seqs = seq_lens.shape[0]
    num_rows = num_seqs if query_start_loc is None else int(query_start_loc[-1])
    _check_shapes(query, k_cache, v_cache, block_tables, num_seqs, num_rows)
    query, k_cache, v_cache = _rows(query), _rows(k_cache), _rows(v_cache)
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty(query.shape, dtype=query.dtype)
    ks, vs = k_cache.stride(), v_cache.stride()
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    kv = cpu_kernels.KVCache(k_cache.data_ptr(), v_cache.data_ptr(), ks[0], ks[1], ks[2], vs[0], vs[1],
                             vs[2], num_blocks, _DTYPE_CODES[k_cache.dtype], block_size, num_kv_heads,
                             head_dim)
    queries = cpu_kernels.Queries(query.data_ptr(), out.data_ptr(), query.stride(0), query.stride(1),
                                  out.stride(0), out.stride(1), _DTYPE_CODES[query.dtype], query.shape[1])
    seqs = cpu_kernels.Seqs(block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
                            seq_lens.data_ptr(),
                            None if query_start_loc is None else query_start_loc.data_ptr(), num_seqs)
    status = fn(ctypes.byref(queries), ctypes.byref(kv), ctypes.byref(seqs), scale,
                torch.get_num_threads(), *extra)
    if status != 0:
        raise ValueError(f"paged attention kernel: {cpu_kernels.STATUS_MESSAGES.get(status, status)}")
    return out


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: Sequence[int] | torch.Tensor,
                      seq_lens: Sequence[int] | torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of prefill chunks over their cached prefix plus the chunk itself.

    query: ``[num_prefill_tokens, num_heads, head_dim]``; the chunk's own K/V must already be in
    the cache. Query i of a chunk of length L in a context of length S sits at position
    S - L + i and sees keys 0..S-L+i.
    """
    if not _supported(query, k_cache, v_cache) or query.shape[0] == 0:
        return torch_backend.prefill_attention(query, k_cache, v_cache, block_tables,
                                               query_start_loc, seq_lens, scale)
    starts, lens = _int32(query_start_loc), _int32(seq_lens)
    if _amx_prefill(query, k_cache, scale):
        return _run(load_kernels().tandem_paged_prefill_amx, query, k_cache, v_cache, block_tables, lens, starts, scale)
    if _AMX and query.dtype == torch.bfloat16:
        long = (starts[1:] - starts[:-1]) >= SDPA_MIN_CHUNK
        if bool(long.all()):
            return torch_backend.prefill_attention(query, k_cache, v_cache, block_tables, starts.tolist(),
                                                   lens.tolist(), scale)
        if bool(long.any()):
            return _split_prefill(query, k_cache, v_cache, block_tables, starts, lens, long, scale)
    return _run(load_kernels().tandem_paged_prefill, query, k_cache, v_cache, block_tables, lens, starts, scale)


def _amx_prefill(query: torch.Tensor, k_cache: torch.Tensor, scale: float) -> bool:
    """Whether this bfloat16 prefill runs on the AMX kernel (module docstring; it takes a step's
    max over unscaled scores, so the scale must be positive)."""
    head_dim, block_size = k_cache.shape[-1], k_cache.shape[1]
    return (_AMX and query.dtype == k_cache.dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256
            and block_size % 16 == 0 and scale > 0 and bool(load_kernels().tandem_prefill_amx_ready()))


def _split_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   starts: torch.Tensor, lens: torch.Tensor, long: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA for the sequences marked ``long``, the kernel for the others, in one output."""
    out = torch.empty_like(query)
    for use_sdpa in (True, False):
        seqs = torch.nonzero(long if use_sdpa else ~long).flatten()
        if seqs.numel() == 0:
            continue
        q_lens = starts[seqs + 1] - starts[seqs]
        rows = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in seqs.tolist()])
        sub_starts = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)])
        sub_query, sub_tables, sub_lens = query[rows], block_tables[seqs], lens[seqs].contiguous()
        if use_sdpa:
            part = torch_backend.prefill_attention(sub_query, k_cache, v_cache, sub_tables, sub_starts.tolist(),
                                                   sub_lens.tolist(), scale)
        else:
            part = _run(load_kernels().tandem_paged_prefill, sub_query, k_cache, v_cache, sub_tables, sub_lens,
                        sub_starts, scale)
        out[rows] = part
    return out


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                     scale: float, *, partition_tokens: int = DECODE_PARTITION_TOKENS) -> torch.Tensor:
    """One query token per sequence over its whole cached context.

    query: ``[num_seqs, num_heads, head_dim]``; seq_lens count the current token, whose K/V is
    already cached. A sequence of length 0 (batch padding) yields zeros. Contexts longer than
    ``partition_tokens`` are split into partitions of that many keys, merged by log-sum-exp
    (0: never split).
    """
    if not _supported(query, k_cache, v_cache):
        return torch_backend.decode_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                              max_seq_len, scale)
    if partition_tokens < 0:
        raise ValueError(f"partition_tokens={partition_tokens} must be >= 0 (0: never split)")
    return _run(load_kernels().tandem_paged_decode, query, k_cache, v_cache, block_tables,
                _int32(seq_lens), None, scale, partition_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.attention.cpu_backend",
                                     description="Build the CPU attention kernels ahead of time.")
    parser.add_argument("--build", action="store_true", help="compile (or find cached) and load them")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 2
    try:
        load_kernels()
    except KernelBuildError as e:
        print(f"CPU attention kernels not built: {e}", file=sys.stderr)
        return 1
    print(f"CPU attention kernels ready: {native.library_path(cpu_kernels.SOURCE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
