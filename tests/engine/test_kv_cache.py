"""KV pool layout, shared-memory mapping from another process, and the capacity lines."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.kv_cache import KVPool, KVPoolShape, capacity_lines

LAYOUT = KVPoolShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def test_layout_sizes():
    assert LAYOUT.block_nbytes == 4 * 2 * 8 * 4
    assert LAYOUT.bytes_per_block == 2 * 3 * LAYOUT.block_nbytes


def test_layer_caches_are_views_of_one_tensor():
    pool = KVPool(LAYOUT, num_blocks=5, device=torch.device("cpu"), shared_memory=False)
    caches = pool.layer_caches()
    assert len(caches) == 3
    k1, v1 = caches[1]
    assert tuple(k1.shape) == (5, 4, 2, 8)
    k1[2, 3, 1, 7] = 42.0
    v1[0, 0, 0, 0] = -1.0
    assert pool.tensor[1, 0, 2, 3, 1, 7] == 42.0
    assert pool.tensor[1, 1, 0, 0, 0, 0] == -1.0
    assert pool.nbytes == 5 * LAYOUT.bytes_per_block


def test_shared_pool_is_visible_to_another_process():
    pool = KVPool(LAYOUT, num_blocks=5, device=torch.device("cpu"), shared_memory=True)
    path = pool.shm_path
    assert path is not None and path.exists() and str(path).startswith("/dev/shm/")
    numel = pool.tensor.numel()
    # Another process maps the same file and writes one value into layer 2, V, block 4.
    code = (f"import torch; t = torch.from_file({str(path)!r}, shared=True, size={numel}, dtype=torch.float32)"
            f".view(3, 2, 5, 4, 2, 8); t[2, 1, 4, 1, 0, 3] = 7.5")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert pool.tensor[2, 1, 4, 1, 0, 3].item() == 7.5
    assert int((pool.tensor != 0).sum()) == 1
    pool.close()
    assert not path.exists()


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least 1 block"):
        KVPool(LAYOUT, num_blocks=0, device=torch.device("cpu"))


def test_capacity_lines_match_design_example():
    assert capacity_lines(17131, 64, 20000) == (
        "num_blocks_global: 17131",
        "KV cache: 17131 blocks x 64 tokens = 1096384 tokens; ~54 concurrent requests at 20000 tokens/request")
    # 313 blocks per 20000-token request (rounded up), 17131 // 313 = 54
    assert capacity_lines(10, 16, 17)[1].endswith("~5 concurrent requests at 17 tokens/request")
