from __future__ import annotations

import pytest
import torch

from kvtransfer.blockcopy import MAX_SLICE_RUNS, copy_blocks, copy_blocks_numpy, copy_blocks_torch, pair_runs, runs
from kvtransfer.layout import flat_bytes
from tests.kvtransfer.conftest import random_pool, u8


def test_runs():
    assert runs([]) == []
    assert runs([3, 4, 5, 9, 10, 2]) == [(3, 0, 3), (9, 3, 2), (2, 5, 1)]


def test_pair_runs():
    assert pair_runs([0, 1, 2, 7], [5, 6, 9, 10]) == [(0, 5, 2), (2, 9, 1), (7, 10, 1)]


ONE_RUN = ([0, 1, 2], [4, 5, 6])
FRAGMENTED = (list(range(11, -1, -1)), [3, 0, 9, 14, 1, 7, 12, 5, 10, 2, 15, 8])


@pytest.mark.parametrize("src_ids, dst_ids", [ONE_RUN, FRAGMENTED], ids=["one-run", "fragmented"])
@pytest.mark.parametrize("impl", ["dispatch", "numpy", "torch"])
def test_copy_blocks_exact(layout, src_ids, dst_ids, impl):
    assert (len(pair_runs(src_ids, dst_ids)) > MAX_SLICE_RUNS) == (len(src_ids) == 12)
    src = random_pool(layout, 12, seed=5)
    dst = torch.zeros(layout.pool_shape(16), dtype=torch.bfloat16)
    sf, df = flat_bytes(src), flat_bytes(dst)
    pairs = pair_runs(src_ids, dst_ids)
    if impl == "dispatch":
        copy_blocks(layout, sf, 12, df, 16, [0, 2], src_ids, dst_ids)
    elif impl == "numpy":
        copy_blocks_numpy(layout, sf.numpy(), 12, df.numpy(), 16, [0, 2], pairs, src_ids, dst_ids)
    else:  # the CUDA path, run on CPU tensors
        copy_blocks_torch(layout, sf, 12, df, 16, [0, 2], pairs, src_ids, dst_ids)
    expected = torch.zeros_like(u8(dst))
    for layer in (0, 2):
        expected[layer, :, dst_ids] = u8(src)[layer, :, src_ids]
    assert torch.equal(u8(dst), expected)
    assert torch.count_nonzero(u8(dst)[1]) == 0
