"""Random paged-KV inputs for the attention tests, and a naive float64 attention reference.

Block ids are shuffled, so a sequence's blocks are neither contiguous nor in order. Every slot no
sequence owns — spare blocks, the tail of each sequence's last block — and every block-table
entry past a sequence's last block can be poisoned, so a kernel that reads outside a sequence's
context changes its output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    k_cache: torch.Tensor       # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with spare block ids
    seq_lens: list[int]
    spare_block_ids: list[int]  # blocks no table row uses for its context

    @property
    def block_size(self) -> int:
        return int(self.k_cache.shape[1])

    def poison(self, value: float) -> None:
        """Fill every slot that lies outside all sequences' contexts with ``value``."""
        for cache in (self.k_cache, self.v_cache):
            cache[self.spare_block_ids] = value
            for row, seq_len in enumerate(self.seq_lens):
                if seq_len % self.block_size:
                    last_block = int(self.block_tables[row, (seq_len - 1) // self.block_size])
                    cache[last_block, seq_len % self.block_size:] = value


def make_paged_kv(gen: torch.Generator, seq_lens: list[int], *, num_kv_heads: int, head_dim: int,
                  block_size: int, dtype: torch.dtype = torch.float32, num_spare_blocks: int = 3,
                  extra_table_columns: int = 1) -> PagedKV:
    """Random caches with ``seq_lens`` tokens per sequence in shuffled blocks, on gen's device."""
    device = gen.device
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    block_ids = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    spare = block_ids[:num_spare_blocks]
    width = max(blocks_per_seq) + extra_table_columns
    table_rows, next_id = [], num_spare_blocks
    for row, n in enumerate(blocks_per_seq):
        own = block_ids[next_id:next_id + n]
        next_id += n
        # padding points at spare (poisoned) blocks, as a stale id in a reused table would
        table_rows.append(own + [spare[(row + j) % num_spare_blocks] for j in range(width - n)])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    block_tables = torch.tensor(table_rows, dtype=torch.int32, device=device)
    return PagedKV(k_cache, v_cache, block_tables, list(seq_lens), spare)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[seq_len, num_kv_heads, head_dim]`` float64, one token at a time from the paged cache."""
    block_size = cache.shape[1]
    tokens = [cache[int(block_table[p // block_size]), p % block_size] for p in range(seq_len)]
    return torch.stack(tokens).double()


def naive_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    context_len: int, scale: float) -> torch.Tensor:
    """Causal attention in float64 with explicit loops: query i sits at ``context_len + i``.

    query: ``[q_len, num_heads, head_dim]``; keys/values: ``[seq_len, num_kv_heads, head_dim]``.
    """
    q_len, num_heads, _ = query.shape
    group = num_heads // keys.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for i in range(q_len):
        visible = context_len + i + 1
        for h in range(num_heads):
            k = keys[:visible, h // group]
            v = values[:visible, h // group]
            scores = (k @ query[i, h].double()) * scale
            weights = torch.exp(scores - scores.max())
            out[i, h] = (weights / weights.sum()) @ v
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())
