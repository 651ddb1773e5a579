"""create_receiver / create_sender / auto backend selection."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtransfer import FakeFabric, create_receiver, create_sender, create_shm_pool, remove_shm_pool, select_backend
from tests.kvtransfer.conftest import random_pool


def test_auto_offers_shm_and_tcp_and_picks_shm_on_the_same_host(layout):
    pool, path = create_shm_pool(layout, 4)
    receiver = create_receiver(pool, layout, "auto", shm_path=path)
    try:
        d = receiver.descriptor
        assert d.transports == ("shm", "tcp") and d.shm_path == path
        assert d.address.startswith("tcp://127.0.0.1:")
        src = random_pool(layout, 4, 0)
        assert select_backend(d, src) == "shm"
        assert select_backend(dataclasses.replace(d, host_id="elsewhere/1"), src) == "tcp"
        sender = create_sender(d.to_bytes(), src, layout)
        assert sender.backend == "shm"
        sender.close()
    finally:
        receiver.close()
        remove_shm_pool(path)


def test_auto_without_shm_is_tcp(layout):
    receiver = create_receiver(torch.zeros(layout.pool_shape(4), dtype=torch.bfloat16), layout)
    try:
        assert receiver.descriptor.transports == ("tcp",)
        assert select_backend(receiver.descriptor, random_pool(layout, 4, 0)) == "tcp"
        with pytest.raises(ValueError, match="shm"):
            create_sender(receiver.descriptor, random_pool(layout, 4, 0), layout, "shm")
    finally:
        receiver.close()


def test_bad_arguments(layout):
    pool = torch.zeros(layout.pool_shape(4), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shm_path"):
        create_receiver(pool, layout, "shm")
    with pytest.raises(ValueError, match="CUDA"):
        create_receiver(pool, layout, "cuda-ipc")
    with pytest.raises(ValueError, match="backend='rdma'"):
        create_receiver(pool, layout, "rdma")
    with pytest.raises(ValueError, match="FakeFabric"):
        create_receiver(pool, layout, "fake")
    fabric = FakeFabric()
    receiver = create_receiver(pool, layout, "fake", fabric=fabric)
    assert receiver.descriptor.address.startswith("fake://")
    with pytest.raises(ValueError, match="no usable transport"):
        select_backend(receiver.descriptor, pool)
    with pytest.raises(ValueError, match="FakeFabric"):
        create_sender(receiver.descriptor, pool, layout, "fake")
    receiver.close()
    with pytest.raises(ValueError, match="no fake receiver"):
        create_sender(receiver.descriptor, pool, layout, "fake", fabric=fabric)
