"""Block copies between pools by byte offset (sender processes of one-sided backends).

Consecutive (src, dst) pairs are merged into runs so a request of contiguous blocks costs one
slice copy per (layer, K|V); badly fragmented requests switch to one gather/scatter per layer.
CPU copies go through numpy (a plain single-threaded memcpy): on a loaded 2-core host torch's
parallel copy stalls on its thread barrier and its spinning workers slow the ZeroMQ threads.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .layout import KVLayout

MAX_SLICE_RUNS = 8  # beyond this many runs per (layer, K|V), index_copy_ beats Python loops


def runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge consecutive ids into ``(first_id, index_of_first, count)`` runs."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if out and out[-1][0] + out[-1][2] == b:
            first, start, count = out[-1]
            out[-1] = (first, start, count + 1)
        else:
            out.append((b, i, 1))
    return out


def pair_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge pairs where both ids advance by one into ``(src_first, dst_first, count)``."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def copy_blocks(layout: KVLayout, src_flat: torch.Tensor, src_num_blocks: int,
                dst_flat: torch.Tensor, dst_num_blocks: int, layers: Sequence[int],
                src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                non_blocking: bool = False) -> None:
    """Copy blocks of ``layers`` (K and V) between two flat uint8 pool views."""
    pairs = pair_runs(src_block_ids, dst_block_ids)
    if src_flat.device.type == "cpu" and dst_flat.device.type == "cpu":
        copy_blocks_numpy(layout, src_flat.numpy(), src_num_blocks, dst_flat.numpy(),
                           dst_num_blocks, layers, pairs, src_block_ids, dst_block_ids)
        return
    copy_blocks_torch(layout, src_flat, src_num_blocks, dst_flat, dst_num_blocks, layers, pairs,
                      src_block_ids, dst_block_ids, non_blocking)


def copy_blocks_torch(layout: KVLayout, src_flat: torch.Tensor, src_num_blocks: int,
                      dst_flat: torch.Tensor, dst_num_blocks: int, layers: Sequence[int],
                      pairs: list[tuple[int, int, int]], src_block_ids: Sequence[int],
                      dst_block_ids: Sequence[int], non_blocking: bool = False) -> None:
    """Torch path, for CUDA pools (works on any device)."""
    bn = layout.block_nbytes
    if len(pairs) <= MAX_SLICE_RUNS:
        for layer in layers:
            for kv in (0, 1):
                for s, d, count in pairs:
                    so = layout.offset(layer, kv, s, src_num_blocks)
                    do = layout.offset(layer, kv, d, dst_num_blocks)
                    dst_flat[do:do + count * bn].copy_(src_flat[so:so + count * bn],
                                                       non_blocking=non_blocking)
        return
    src4 = src_flat.view(layout.num_layers, 2, src_num_blocks, bn)
    dst4 = dst_flat.view(layout.num_layers, 2, dst_num_blocks, bn)
    src_idx = torch.tensor(list(src_block_ids), dtype=torch.int64, device=src_flat.device)
    dst_idx = torch.tensor(list(dst_block_ids), dtype=torch.int64, device=dst_flat.device)
    for layer in layers:
        rows = src4[layer].index_select(1, src_idx)
        dst4[layer].index_copy_(1, dst_idx, rows.to(dst_flat.device, non_blocking=non_blocking))


def copy_blocks_numpy(layout: KVLayout, src: np.ndarray, src_num_blocks: int, dst: np.ndarray,
                       dst_num_blocks: int, layers: Sequence[int],
                       pairs: list[tuple[int, int, int]], src_block_ids: Sequence[int],
                       dst_block_ids: Sequence[int]) -> None:
    bn = layout.block_nbytes
    if len(pairs) <= MAX_SLICE_RUNS:
        for layer in layers:
            for kv in (0, 1):
                for s, d, count in pairs:
                    so = layout.offset(layer, kv, s, src_num_blocks)
                    do = layout.offset(layer, kv, d, dst_num_blocks)
                    dst[do:do + count * bn] = src[so:so + count * bn]
        return
    src4 = src.reshape(layout.num_layers, 2, src_num_blocks, bn)
    dst4 = dst.reshape(layout.num_layers, 2, dst_num_blocks, bn)
    src_idx = np.asarray(src_block_ids, dtype=np.int64)
    dst_idx = np.asarray(dst_block_ids, dtype=np.int64)
    for layer in layers:
        dst4[layer][:, dst_idx] = src4[layer][:, src_idx]
