from __future__ import annotations

import os

import pytest
import torch

from kvtransfer.region import create_shm_pool, map_shm_pool, remove_shm_pool


def test_create_map_remove(layout):
    pool, path = create_shm_pool(layout, 5)
    try:
        assert path.startswith("/dev/shm/tandem-kv-")
        assert os.stat(path).st_size == layout.pool_nbytes(5) == 3 * 2 * 5 * 128
        assert pool.shape == layout.pool_shape(5) and pool.dtype == torch.bfloat16
        assert torch.count_nonzero(pool.view(torch.uint8)) == 0
        other = map_shm_pool(layout, 5, path)
        pool[2, 1, 4] = 3.0
        assert torch.equal(other[2, 1, 4], torch.full((4, 2, 8), 3.0, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="layout needs"):
            map_shm_pool(layout, 6, path)
    finally:
        remove_shm_pool(path)
    assert not os.path.exists(path)
    remove_shm_pool(path)  # idempotent


def test_create_refuses_zero_blocks(layout):
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        create_shm_pool(layout, 0)
