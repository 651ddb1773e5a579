"""/dev/shm space (kvtransfer.region): a pool that does not fit is refused when it is created,
with nothing left behind, and a pool that fits has every page backed, so no later write into it
(the receiver's or a same-host sender's) can die of SIGBUS on a full tmpfs."""
from __future__ import annotations

import os

import pytest
import torch

import kvtransfer
from tandem_shm.pools import POOL_PREFIX, SHM_DIR

LAYOUT = kvtransfer.KVLayout.from_dtype(torch.float32, block_size=16, num_layers=2, num_kv_heads=2, head_dim=16)


def pool_files() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"{POOL_PREFIX}{os.getpid()}-")}


def test_a_pool_larger_than_free_dev_shm_is_refused_at_creation_and_leaves_no_file():
    st = os.statvfs(SHM_DIR)
    num_blocks = (st.f_bavail * st.f_frsize) // LAYOUT.pool_nbytes(1) + 1024
    before = pool_files()
    with pytest.raises(ValueError, match="cannot create a .* byte KV pool in /dev/shm"):
        kvtransfer.create_shm_pool(LAYOUT, num_blocks)
    assert pool_files() == before


def test_a_new_pool_has_every_page_backed():
    pool, path = kvtransfer.create_shm_pool(LAYOUT, 64)
    try:
        assert os.stat(path).st_blocks * 512 >= LAYOUT.pool_nbytes(64)
        assert pool.abs().sum().item() == 0
    finally:
        kvtransfer.remove_shm_pool(path)
