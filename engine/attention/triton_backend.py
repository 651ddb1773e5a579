"""Paged attention as Triton kernels: the CUDA path, with torch_backend as its reference.

Runs inside a worker's engine thread. The functions take the same arguments and keep the same
cache layout as ``engine.attention.torch_backend``: caches are per layer ``[num_blocks,
block_size, num_kv_heads, head_dim]`` and a sequence's token at position p lives in block
``block_table[p // block_size]`` at offset ``p % block_size``. Query head h reads kv head
``h // (num_heads // num_kv_heads)``. Scores, softmax and accumulation are float32; outputs have
the query's dtype. Block-table entries past a sequence's last block and cache slots past its
length are never read, so they may hold anything (stale blocks, padding ids, NaN).

Importing this module compiles nothing and touches no device; kernels compile on first launch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Decode splits a sequence's context across programs only while each split keeps this many
# tokens; below that the partial-result traffic costs more than the parallelism gains.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_DECODE_SPLITS = 32


# ----------------------------------------------------------------------------------- write_kv

@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_kv_heads,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_kcb, stride_kcs, stride_kch, stride_kcd,
                     stride_vcb, stride_vcs, stride_vch, stride_vcd,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # negative slots are padding tokens with nowhere to go
        # slot = block_id * block_size + offset_in_block
        block_id = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, HEAD_DIM)[None, :]
        mask = heads < num_kv_heads
        src = token.to(tl.int64)
        key = tl.load(key_ptr + src * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
        value = tl.load(value_ptr + src * stride_vt + heads * stride_vh + dims * stride_vd,
                        mask=mask)
        k_dst = block_id * stride_kcb + offset * stride_kcs + heads * stride_kch + dims * stride_kcd
        v_dst = block_id * stride_vcb + offset * stride_vcs + heads * stride_vch + dims * stride_vcd
        tl.store(k_cache_ptr + k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new tokens' K/V ``[num_tokens, num_kv_heads, head_dim]`` at their slots.

    Tokens whose slot is negative (batch padding) are skipped.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _check_pow2(block_size=block_size, head_dim=head_dim)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, num_kv_heads,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
    )


# ------------------------------------------------------------------------------ shared pieces

@triton.jit
def _load_kv_tile(cache_ptr, block_table_ptr, positions, mask, kv_head,
                  stride_b, stride_s, stride_h, stride_d,
                  BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr):
    """Gather ``[len(positions), HEAD_DIM]`` of one kv head from the paged cache."""
    if MASKED:
        block_ids = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=mask, other=0)
    else:
        block_ids = tl.load(block_table_ptr + positions // BLOCK_SIZE)
    # position p is at offset p % block_size of block block_table[p // block_size]
    rows = (block_ids.to(tl.int64) * stride_b + (positions % BLOCK_SIZE) * stride_s
            + kv_head * stride_h)
    ptrs = cache_ptr + rows[:, None] + tl.arange(0, HEAD_DIM)[None, :] * stride_d
    if MASKED:
        # other=0 keeps garbage (even NaN) in unused slots out of the P @ V product
        return tl.load(ptrs, mask=mask[:, None], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    """``a @ b`` accumulated in float32."""
    if DOT_PRECISION == "upcast":
        # Same math as the tensor cores: products of 16-bit floats are exact in float32.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _online_softmax_step(qk, v, acc, l_i, m_i, DOT_PRECISION: tl.constexpr):
    """Fold one tile of log2-scaled scores ``qk`` and values ``v`` into the running state."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
    return acc, l_i, m_new


def _check_pow2(**sizes: int) -> None:
    for name, size in sizes.items():
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two for the Triton backend, got {size}; "
                             "use attention_backend=torch")


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16 and triton.knobs.runtime.interpret:
        return "upcast"  # TRITON_INTERPRET multiplies bfloat16 as raw uint16 bits
    # tf32 would cost float32 models ~1e-3 relative error; they are rare on GPU, so stay exact.
    return "ieee" if dtype == torch.float32 else "tf32"


def _as_device_int32(values: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=torch.int32)
    # Not torch.tensor(..., device=device): that copy is blocking, and a blocking host-to-device
    # copy synchronizes the stream, so every layer's prefill would wait for the GPU to drain.
    # A non-blocking copy from pageable memory is staged by the driver before it returns.
    return torch.tensor(list(values), dtype=torch.int32).to(device, non_blocking=True)


# ------------------------------------------------------------------------------------ prefill

@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr,
                    query_start_loc_ptr, seq_lens_ptr, scale_log2, num_queries_per_kv,
                    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
                    stride_kb, stride_ks, stride_kh, stride_kd,
                    stride_vb, stride_vs, stride_vh, stride_vd, stride_bt,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:  # the grid is sized for the longest chunk
        seq_len = tl.load(seq_lens_ptr + seq)
        # Query i of the chunk sits at position context_len + i (chunked prefill over a prefix).
        context_len = seq_len - q_len
        kv_head = head // num_queries_per_kv
        table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        dims = tl.arange(0, HEAD_DIM)
        tokens = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh
                    + dims[None, :] * stride_qd, mask=row_mask[:, None], other=0.0)
        q_pos = context_len + rows

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        # Keys before the tile's first query position are visible to every row: no mask.
        first_pos = context_len + tile * BLOCK_M
        unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
        for start in range(0, unmasked_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            k = _load_kv_tile(k_cache_ptr, table_ptr, pos, None, kv_head, stride_kb, stride_ks,
                              stride_kh, stride_kd, BLOCK_SIZE, HEAD_DIM, False)
            v = _load_kv_tile(v_cache_ptr, table_ptr, pos, None, kv_head, stride_vb, stride_vs,
                              stride_vh, stride_vd, BLOCK_SIZE, HEAD_DIM, False)
            qk = _dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION) * scale_log2
            acc, l_i, m_i = _online_softmax_step(qk, v.to(q.dtype), acc, l_i, m_i, DOT_PRECISION)

        # The diagonal: causal mask and the end of the context. Every row sees position 0, so
        # no row is ever fully masked and the running max stays finite.
        masked_end = tl.minimum(seq_len, first_pos + BLOCK_M)
        for start in range(unmasked_end, masked_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            kv_mask = pos < seq_len
            k = _load_kv_tile(k_cache_ptr, table_ptr, pos, kv_mask, kv_head, stride_kb, stride_ks,
                              stride_kh, stride_kd, BLOCK_SIZE, HEAD_DIM, True)
            v = _load_kv_tile(v_cache_ptr, table_ptr, pos, kv_mask, kv_head, stride_vb, stride_vs,
                              stride_vh, stride_vd, BLOCK_SIZE, HEAD_DIM, True)
            qk = _dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION) * scale_log2
            visible = kv_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))
            acc, l_i, m_i = _online_softmax_step(qk, v.to(q.dtype), acc, l_i, m_i, DOT_PRECISION)

        out = acc / l_i[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh
                 + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None])


def _prefill_tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): query rows and K/V rows per tile, warps per program.

    Sized so the sm_90 build keeps everything in registers (checked with cuobjdump: 16-bit,
    head_dim 128 takes 192 registers and no local memory). On an H100, 16-bit head_dim 128 ran
    13-20% faster with 64-row query tiles than with 128 (docs/gpu_validation.md).
    """
    if dtype == torch.float32:  # exact float32 dots run on FMA units and need more registers
        return (64, 32, 8) if head_dim <= 64 else (32, 16, 8)
    if head_dim <= 128:
        return 64, 64, 4
    return 64, 32, 8


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: Sequence[int] | torch.Tensor,
                      seq_lens: Sequence[int] | torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of prefill chunks over their cached prefix plus the chunk itself.

    query: ``[num_prefill_tokens, num_heads, head_dim]``; the chunk's own K/V must already be in
    the cache. Query i of a chunk of length L in a context of length S sits at position
    S - L + i and sees keys 0..S-L+i. ``query_start_loc`` and ``seq_lens`` may be host
    sequences or device tensors; with tensors the grid is sized from the token count, so the
    host never waits on the device.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_pow2(block_size=block_size, head_dim=head_dim)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = len(seq_lens)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if isinstance(query_start_loc, torch.Tensor):
        max_q_len = num_tokens
    else:
        max_q_len = max(b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:]))
    block_m, block_n, num_warps = _prefill_tiles(head_dim, query.dtype)
    grid = (triton.cdiv(max_q_len, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, block_tables,
        _as_device_int32(query_start_loc, query.device), _as_device_int32(seq_lens, query.device),
        scale * _LOG2E, num_heads // num_kv_heads,
        *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(query.dtype), num_warps=num_warps, num_stages=2,
    )
    return out


# ------------------------------------------------------------------------------------- decode

@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
                   block_tables_ptr, seq_lens_ptr, scale_log2, num_queries_per_kv, split_len,
                   stride_qs, stride_qh, stride_qd, stride_os, stride_oh, stride_od,
                   stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_vb, stride_vs, stride_vh, stride_vd, stride_bt,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program: one sequence, one kv head's group of query heads, one span of the context."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # A split past a short sequence's end runs no iterations; the reduce kernel ignores it.
    start = split * split_len
    end = tl.minimum(seq_len, start + split_len)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    group = tl.arange(0, BLOCK_H)
    head_mask = group < num_queries_per_kv
    heads = kv_head * num_queries_per_kv + group
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
                + dims[None, :] * stride_qd, mask=head_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        kv_mask = pos < end
        k = _load_kv_tile(k_cache_ptr, table_ptr, pos, kv_mask, kv_head, stride_kb, stride_ks,
                          stride_kh, stride_kd, BLOCK_SIZE, HEAD_DIM, True)
        v = _load_kv_tile(v_cache_ptr, table_ptr, pos, kv_mask, kv_head, stride_vb, stride_vs,
                          stride_vh, stride_vd, BLOCK_SIZE, HEAD_DIM, True)
        qk = _dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION) * scale_log2
        qk = tl.where(kv_mask[None, :], qk, float("-inf"))
        acc, l_i, m_i = _online_softmax_step(qk, v.to(q.dtype), acc, l_i, m_i, DOT_PRECISION)

    # An empty context (a padded batch entry with seq_len 0) gives zeros, not NaN.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT_K:
        # partials: out [num_seqs, num_heads, num_splits, HEAD_DIM], lse [..., num_splits]
        num_heads = num_queries_per_kv * tl.num_programs(1)
        row = (seq.to(tl.int64) * num_heads + heads) * tl.num_programs(2) + split
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=head_mask[:, None])
        tl.store(partial_lse_ptr + row, m_i + tl.math.log2(l_safe), mask=head_mask)
    else:
        tl.store(out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh
                 + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
                 mask=head_mask[:, None])


@triton.jit
def _decode_reduce_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, seq_lens_ptr, split_len,
                          num_splits, stride_os, stride_oh, stride_od,
                          HEAD_DIM: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    """Merge one (sequence, head)'s split partials, weighting each by its softmax mass."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    splits = tl.arange(0, BLOCK_SPLITS)
    valid = splits < tl.minimum(tl.cdiv(seq_len, split_len), num_splits)
    row = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(partial_lse_ptr + row, mask=valid, other=float("-inf"))
    lse_max = tl.maximum(tl.max(lse, 0), -1e30)  # stays finite when no split is valid
    weights = tl.where(valid, tl.math.exp2(lse - lse_max), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    partial = tl.load(partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
                      mask=valid[:, None], other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + dims * stride_od,
             out.to(out_ptr.dtype.element_ty))


def _num_decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                       device: torch.device) -> int:
    """Split long contexts until the launch roughly fills the GPU twice over."""
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * num_sms, num_seqs * num_kv_heads)
    most = max(1, min(_MAX_DECODE_SPLITS, max_seq_len // _MIN_TOKENS_PER_SPLIT))
    return max(1, min(wanted, most))


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                     scale: float, *, num_splits: int | None = None) -> torch.Tensor:
    """One query token per sequence over its whole cached context (paged, split-K).

    query: ``[num_seqs, num_heads, head_dim]``; seq_lens count the current token, whose K/V is
    already cached, and ``max_seq_len`` bounds them (a host int). ``num_splits`` overrides how
    many programs share one sequence's context (default: a heuristic from the GPU's SM count);
    with more than one, a second kernel merges the partial softmaxes.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_pow2(block_size=block_size, head_dim=head_dim)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    max_seq_len = max(int(max_seq_len), 1)
    if num_splits is None:
        num_splits = _num_decode_splits(num_seqs, num_kv_heads, max_seq_len, query.device)
    block_n, num_warps = (32, 8) if query.dtype == torch.float32 else (64, 4)
    # Whole tiles per split, so only the last tile of a sequence needs its mask to do anything.
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_seq_len, split_len)
    num_queries_per_kv = num_heads // num_kv_heads
    seq_lens = seq_lens.to(device=query.device, dtype=torch.int32)
    if num_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim,
                                  dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                                  device=query.device)
    else:
        partial_out = partial_lse = out  # unused by the kernel
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, partial_out, partial_lse, block_tables, seq_lens,
        scale * _LOG2E, num_queries_per_kv, split_len,
        *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(num_queries_per_kv)), BLOCK_N=block_n,
        SPLIT_K=num_splits > 1, DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=num_warps, num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            partial_out, partial_lse, out, seq_lens, split_len, num_splits, *out.stride(),
            HEAD_DIM=head_dim, BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        )
    return out
