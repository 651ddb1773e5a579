"""Mixture-of-experts as two Triton grouped GEMMs: the CUDA path of ``engine/models/moe.py``.

Runs inside a worker's engine thread. ``moe.grouped_experts`` (torch, one matmul pair per
expert that got tokens) is the CPU path and the reference. Here every (token, expert) pair --
pair ``p = token * top_k + slot`` -- is sorted by expert into segments padded to a multiple of
``BLOCK_M`` rows, so each ``BLOCK_M`` block of the sorted order belongs to one expert. Then:

1. ``_gate_up_kernel``: one launch over (row block, feature tile) for all experts. A program
   gathers its block's token rows of ``x``, multiplies them by its expert's gate and up rows of
   ``w13`` into two float32 accumulators and stores ``silu(gate) * up`` in the model dtype, in
   sorted order.
2. ``_down_kernel``: one launch over (row block, hidden tile); multiplies those rows by the
   expert's ``w2``, scales each row by its pair's routing weight and writes it, float32, at row
   ``p`` of a ``[num_tokens * top_k, hidden]`` buffer.
3. The buffer viewed ``[num_tokens, top_k, hidden]`` is summed over ``top_k`` (no atomics, so
   the result does not depend on the order programs run in).

The sort, the padding and the block -> expert table are about twenty small torch ops on the
device with no host synchronisation: the grid is sized for the worst case (``cdiv(pairs,
BLOCK_M)`` blocks plus one partial block per expert that can be hit) and programs past the last
real block exit. At decode sizes those launches, not the GEMMs, set the time; errors and timings
on an H100 are in docs/gpu_validation.md.

Importing this module compiles nothing and touches no device; kernels compile on first launch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Tiles(NamedTuple):
    """Launch shape: rows per block, output features and reduction step per program, warps,
    and software-pipeline stages (ignored by the interpreter)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b`` in float32 (as ``engine/attention/triton_backend.py``'s ``_dot``)."""
    if DOT_PRECISION == "upcast":
        # The interpreter multiplies bfloat16 as raw uint16 bits; 16-bit products are exact in float32.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, h_ptr, sorted_pairs_ptr, block_experts_ptr,
                    num_pairs, num_experts, top_k, hidden, intermediate,
                    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:   # past the last real block
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs            # num_pairs marks a segment's padding rows
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < intermediate
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xk
    # w13[expert] holds the expert's gate rows [0, intermediate) then its up rows; read transposed.
    gate_ptrs = w13_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    up_ptrs = gate_ptrs + intermediate * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_mask = ks < hidden - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate = _dot(a, tl.load(gate_ptrs, mask=w_mask, other=0.0), gate, DOT_PRECISION)
        up = _dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), up, DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_xk
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    act = gate * tl.sigmoid(gate) * up      # SiLU(gate) * up, in float32
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :] * stride_hn
    tl.store(h_ptrs, act.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr,
                 num_pairs, num_experts, hidden, intermediate,
                 stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + ks[None, :] * stride_hk
    w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(intermediate, BLOCK_K)):
        k_mask = ks < intermediate - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(a, w, acc, DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_hk
        w_ptrs += BLOCK_K * stride_wk
    acc = acc * tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & col_mask[None, :])


def dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16 and triton.knobs.runtime.interpret:
        return "upcast"
    # Float32 experts stay exact (tf32 would cost ~1e-3 relative error), as the attention kernels do.
    return "ieee" if dtype == torch.float32 else "tf32"


def choose_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> Tiles:
    """Rows per block near the mean rows per expert, so a decode step's few pairs do not pad
    every expert's segment to 64 rows; 16 is the least ``tl.dot`` takes."""
    rows_per_expert = num_pairs / num_experts
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64
    if dtype == torch.float32:
        return Tiles(block_m, 64, 32, 4, 2)
    return Tiles(block_m, 64, 64, 4, 3)


def sort_pairs(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``sorted_pairs`` int32 ``[num_blocks * block_m]``, ``block_experts`` int32 ``[num_blocks]``).

    Expert e's pairs, in pair order, fill ``sorted_pairs[start_e : start_e + count_e]`` where
    ``start_e`` is the sum of the earlier experts' counts each rounded up to ``block_m``; the rest
    of each segment and everything past the last one hold ``num_pairs``. ``block_experts[b]`` is
    the expert of rows ``[b * block_m, (b + 1) * block_m)``, or ``num_experts`` past the last
    segment. No value is read back to the host.
    """
    flat = expert_ids.flatten()
    num_pairs = flat.numel()
    device = flat.device
    # Each expert that is hit adds at most one partly filled block.
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    seg_ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    # The i-th pair in expert order is pair order[i]; its row is its expert's segment start
    # plus its rank among that expert's pairs (i minus the number of pairs of earlier experts).
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    rows = (seg_ends - padded)[sorted_experts] + rank
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[rows] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    # The first segment that ends after a block's first row is the block's; none is num_experts.
    block_experts = torch.searchsorted(seg_ends, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  expert_ids: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """float32 ``[T, hidden]``: ``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` with
    ``expert_e(v) = w2[e] @ (silu(g) * u)``, ``g, u = split(w13[e] @ v)``; the arguments are
    ``moe.Experts``'s (``w13`` ``[E, 2 * f, hidden]``, ``w2`` ``[E, hidden, f]``)."""
    num_tokens, top_k = expert_ids.shape
    num_experts, two_f, hidden = w13.shape
    intermediate = two_f // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    tiles = tiles or choose_tiles(num_pairs, num_experts, w13.dtype)
    precision = dot_precision(w13.dtype)
    sorted_pairs, block_experts = sort_pairs(expert_ids, num_experts, tiles.block_m)
    num_blocks = block_experts.numel()
    h = torch.empty(sorted_pairs.numel(), intermediate, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(intermediate, tiles.block_n))](
        x, w13, h, sorted_pairs, block_experts, num_pairs, num_experts, top_k, hidden, intermediate,
        *x.stride(), *w13.stride(), *h.stride(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION=precision, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, tiles.block_n))](
        h, w2, out, sorted_pairs, block_experts, weights.float().contiguous(),
        num_pairs, num_experts, hidden, intermediate,
        *h.stride(), *w2.stride(), *out.stride(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION=precision, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
