"""The engine's /dev/shm KV pool (engine.kv_cache.KVPool): too big for the free space is a clean
error at start naming the fix, with no file left behind; a pool that fits has every page backed,
so a write into it can never SIGBUS the worker later."""
from __future__ import annotations

import os

import pytest
import torch

from engine.kv_cache import KVPool, KVPoolShape
from tandem_shm.pools import SHM_DIR, pools_of


def layout() -> KVPoolShape:
    return KVPoolShape(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def pool_files() -> set[str]:
    return {p.name for p in pools_of(os.getpid())}


def test_a_pool_larger_than_free_dev_shm_is_a_clean_error_at_start():
    st = os.statvfs(SHM_DIR)
    num_blocks = (st.f_bavail * st.f_frsize) // layout().bytes_per_block + 1024
    before = pool_files()
    with pytest.raises(RuntimeError, match="enlarge /dev/shm"):
        KVPool(layout(), num_blocks, torch.device("cpu"), shared_memory=True)
    assert pool_files() == before


def test_a_shared_memory_pool_has_every_page_backed():
    pool = KVPool(layout(), 64, torch.device("cpu"), shared_memory=True)
    try:
        assert os.stat(pool.shm_path).st_blocks * 512 >= pool.nbytes
    finally:
        pool.close()
