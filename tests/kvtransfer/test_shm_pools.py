"""Shared-memory pools are private (0600) and a descriptor's shm_path is opened only when it
names a Tandem pool of this user under the pool directory: anything else is refused with a
clear error, before any byte is mapped."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from engine.kv_cache import KVPool
from engine.kv_cache import KVPoolShape as EngineLayout
from kvtransfer import (
    KVLayout,
    RegionDescriptor,
    create_receiver,
    create_sender,
    create_shm_pool,
    map_shm_pool,
    remove_shm_pool,
)
from tandem_shm.pools import POOL_NAME, SHM_DIR, pool_name

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_kvtransfer_pools_are_created_0600_whatever_the_umask():
    old = os.umask(0)
    try:
        _, path = create_shm_pool(LAYOUT, 3)
    finally:
        os.umask(old)
    try:
        assert _mode(path) == 0o600
    finally:
        remove_shm_pool(path)


def test_engine_pools_are_created_0600_with_a_name_kvtransfer_accepts():
    old = os.umask(0)
    try:
        pool = KVPool(EngineLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32),
                      num_blocks=3, device=torch.device("cpu"), shared_memory=True)
    finally:
        os.umask(old)
    try:
        assert _mode(pool.shm_path) == 0o600
        assert POOL_NAME.fullmatch(pool.shm_path.name) and str(pool.shm_path.parent) == SHM_DIR
    finally:
        pool.close()


@pytest.mark.parametrize("path", [
    "/etc/passwd",
    f"{SHM_DIR}/not-a-pool",
    f"{SHM_DIR}/../etc/{pool_name()}",
    f"{SHM_DIR}/sub/{pool_name()}",
    f"/tmp/{pool_name()}",
    f"{SHM_DIR}/{pool_name()}x",
])
def test_a_path_that_is_not_a_tandem_pool_is_never_opened(path):
    with pytest.raises(ValueError, match="not a Tandem KV pool"):
        map_shm_pool(LAYOUT, 3, path)


def test_a_pool_named_file_that_is_a_link_or_readable_by_others_is_refused(tmp_path):
    target = tmp_path / "secret.bin"
    target.write_bytes(b"\0" * LAYOUT.pool_nbytes(3))
    link = os.path.join(SHM_DIR, pool_name())
    os.symlink(target, link)
    loose = os.path.join(SHM_DIR, pool_name())
    with open(loose, "wb") as f:
        f.truncate(LAYOUT.pool_nbytes(3))
    os.chmod(loose, 0o644)
    try:
        for path in (link, loose):
            with pytest.raises(ValueError, match="regular file of this user with mode 0600"):
                map_shm_pool(LAYOUT, 3, path)
    finally:
        os.unlink(link)
        os.unlink(loose)


def test_a_descriptor_naming_another_file_gets_no_shm_sender():
    pool, path = create_shm_pool(LAYOUT, 3)
    receiver = create_receiver(pool, LAYOUT, "shm", shm_path=path)
    try:
        good = receiver.descriptor
        forged = RegionDescriptor(good.layout, good.num_blocks, good.transports, good.address, good.host_id,
                                  good.region_id, "/etc/passwd", None, good.curve_public_key)
        src = torch.zeros(LAYOUT.pool_shape(3))
        with pytest.raises(ValueError, match="not a Tandem KV pool"):
            create_sender(forged.to_bytes(), src, LAYOUT, "shm")
    finally:
        receiver.close()
        remove_shm_pool(path)
