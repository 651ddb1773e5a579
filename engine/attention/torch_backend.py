"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

Runs inside a worker's engine thread. Caches are per layer ``[num_blocks, block_size,
num_kv_heads, head_dim]``; a sequence's token at position p lives in block
``block_table[p // block_size]`` at offset ``p % block_size``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.math_utils import cdiv


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new tokens' K/V ``[num_tokens, num_kv_heads, head_dim]`` at their slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` cached tokens of one sequence as ``[num_kv_heads, n, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = cdiv(num_tokens, block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:num_tokens].transpose(0, 1)


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: Sequence[int] | torch.Tensor,
                      seq_lens: Sequence[int] | torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of prefill chunks over their cached prefix plus the chunk itself.

    query: ``[num_prefill_tokens, num_heads, head_dim]``; the chunk's own K/V must already be in
    the cache. Query i of a chunk of length L in a context of length S sits at position
    S - L + i and sees keys 0..S-L+i.
    """
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        q = query[start:end].transpose(0, 1).unsqueeze(0)          # [1, H, L, D]
        k = _gather_context(k_cache, block_tables[i], seq_len).unsqueeze(0).to(q.dtype)
        v = _gather_context(v_cache, block_tables[i], seq_len).unsqueeze(0).to(q.dtype)
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = torch.ones(int(q_len), int(seq_len), dtype=torch.bool, device=q.device)
            mask = mask.tril(diagonal=seq_len - q_len)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                     scale: float) -> torch.Tensor:
    """One query token per sequence over its whole cached context, batched with padding.

    query: ``[num_seqs, num_heads, head_dim]``; seq_lens count the current token, whose K/V is
    already cached.
    """
    num_seqs = query.shape[0]
    block_size = k_cache.shape[1]
    num_blocks = cdiv(max_seq_len, block_size)
    table = block_tables[:, :num_blocks].long()
    # [B, nb, bs, Hkv, D] -> [B, Hkv, nb*bs, D]
    k = k_cache[table].flatten(1, 2).transpose(1, 2).to(query.dtype)
    v = v_cache[table].flatten(1, 2).transpose(1, 2).to(query.dtype)
    q = query.unsqueeze(2)                                          # [B, H, 1, D]
    if num_seqs == 1:
        n = int(max_seq_len)
        o = F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=scale, enable_gqa=True)
    else:
        positions = torch.arange(k.shape[2], device=query.device)
        mask = (positions[None, :] < seq_lens[:, None].to(positions.dtype))[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)
