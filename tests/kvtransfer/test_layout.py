from __future__ import annotations

import pytest
import torch

from kvtransfer.layout import KVLayout, LayoutMismatchError, flat_bytes


def test_block_nbytes_and_offsets(layout):
    assert layout.block_nbytes == 4 * 2 * 8 * 2 == 128
    assert layout.pool_shape(16) == (3, 2, 16, 4, 2, 8)
    assert layout.pool_nbytes(16) == 3 * 2 * 16 * 128
    assert layout.offset(0, 0, 0, 16) == 0
    assert layout.offset(0, 0, 5, 16) == 5 * 128
    assert layout.offset(0, 1, 0, 16) == 16 * 128
    assert layout.offset(2, 1, 15, 16) == ((2 * 2 + 1) * 16 + 15) * 128


def test_offset_matches_tensor_indexing(layout):
    pool = torch.arange(layout.pool_numel(5), dtype=torch.float32).to(torch.bfloat16)
    pool = pool.view(layout.pool_shape(5))
    flat = flat_bytes(pool)
    off = layout.offset(1, 1, 3, 5)
    assert torch.equal(flat[off:off + layout.block_nbytes], pool[1, 1, 3].reshape(-1).view(torch.uint8))


def test_smollm2_layout():
    lo = KVLayout("bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
    assert lo.block_nbytes == 6144
    assert lo.from_dtype(torch.bfloat16, block_size=16, num_layers=30, num_kv_heads=3,
                         head_dim=64) == lo


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype="float64"), "dtype='float64' is not supported"),
    (dict(block_size=0), "block_size must be an int"),
    (dict(head_dim=True), "head_dim must be an int"),
    (dict(num_layers=2.0), "num_layers must be an int"),
    (dict(tp_rank=-1), "tp_rank must be an int"),
])
def test_validation(kwargs, match):
    base = dict(dtype="bfloat16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=match):
        KVLayout(**{**base, **kwargs})


def test_check_compatible_names_every_difference(layout):
    layout.check_compatible(KVLayout("bfloat16", 4, 3, 2, 8))
    other = KVLayout("float16", 4, 3, 2, 8, tp_rank=1)
    with pytest.raises(LayoutMismatchError) as info:
        layout.check_compatible(other)
    assert str(info.value) == ("KV layout mismatch, refusing to transfer: dtype: ours='bfloat16' "
                               "theirs='float16'; tp_rank: ours=0 theirs=1")


def test_check_pool(layout):
    assert layout.check_pool(torch.zeros(layout.pool_shape(7), dtype=torch.bfloat16)) == 7
    with pytest.raises(ValueError, match="dtype"):
        layout.check_pool(torch.zeros(layout.pool_shape(7), dtype=torch.float16))
    with pytest.raises(ValueError, match="does not match layout"):
        layout.check_pool(torch.zeros((3, 2, 7, 4, 2, 4), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        layout.check_pool(torch.zeros((3, 2, 4, 2, 8, 7), dtype=torch.bfloat16).permute(0, 1, 5, 2, 3, 4))
    with pytest.raises(ValueError, match="6 dims"):
        layout.check_pool(torch.zeros(10))


def test_layout_of_pool_reads_the_pool_geometry():
    pool = torch.zeros(3, 2, 5, 4, 2, 8, dtype=torch.bfloat16)
    layout = KVLayout.of_pool(pool, tp_rank=1)
    assert layout == KVLayout("bfloat16", 4, 3, 2, 8, 1)
    assert layout.check_pool(pool) == 5
    with pytest.raises(ValueError, match="a KV pool is"):
        KVLayout.of_pool(torch.zeros(3, 5, 4, 2, 8))
