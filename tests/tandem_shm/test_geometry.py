"""The KV pool's one geometry (tandem_shm/geometry.py) and the two views built on it: the engine's
``KVPoolShape`` (torch dtype) and kvtransfer's ``KVLayout`` (dtype by wire name) give the same
sizes and offsets for the same pool."""
from __future__ import annotations

import torch

from engine.kv_cache import KVPoolShape
from kvtransfer.layout import KVLayout
from tandem_shm.geometry import PoolGeometry

# 3 layers, 4-token blocks, 2 KV heads of 8 bf16 elements: one (layer, K|V, block) run is 128 bytes.
GEOMETRY = PoolGeometry(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, itemsize=2)


def test_sizes_and_offsets():
    assert GEOMETRY.block_nbytes == 4 * 2 * 8 * 2 == 128
    assert GEOMETRY.bytes_per_block == 2 * 3 * 128 == 768
    assert GEOMETRY.pool_shape(16) == (3, 2, 16, 4, 2, 8)
    assert GEOMETRY.pool_numel(16) == 3 * 2 * 16 * 4 * 2 * 8 == 6144
    assert GEOMETRY.pool_nbytes(16) == 16 * 768 == 12288
    assert GEOMETRY.offset(0, 0, 0, 16) == 0
    assert GEOMETRY.offset(0, 1, 0, 16) == 16 * 128
    assert GEOMETRY.offset(2, 1, 15, 16) == ((2 * 2 + 1) * 16 + 15) * 128 == 12160


def test_the_engine_and_the_transfer_views_share_it():
    engine = KVPoolShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
    transfer = KVLayout("bfloat16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    assert engine.geometry == transfer.geometry == GEOMETRY
    assert (engine.block_nbytes, engine.bytes_per_block) == (128, 768)
    assert (transfer.block_nbytes, transfer.pool_nbytes(16), transfer.offset(2, 1, 15, 16)) == (128, 12288, 12160)
