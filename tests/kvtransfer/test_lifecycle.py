"""Shutdown, back-pressure and CurveZMQ: every thread stops, queues stay bounded."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from kvtransfer import (
    CurveKeys,
    KVLayout,
    NotifyPayload,
    RegionDescriptor,
    SenderClosed,
    TransferStatus,
    create_receiver,
    create_sender,
)
from kvtransfer.descriptor import local_host_id
from tests.kvtransfer.conftest import random_pool

pytestmark = pytest.mark.timeout(60)


def _kv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvtransfer-")]


def test_close_stops_every_thread_and_is_idempotent(layout):
    before = _kv_threads()
    pool = torch.zeros(layout.pool_shape(4), dtype=torch.bfloat16)
    receiver = create_receiver(pool, layout, "tcp")
    sender = create_sender(receiver.descriptor, random_pool(layout, 4, 0), layout, "tcp")
    assert sorted(_kv_threads()) == sorted(before + ["kvtransfer-receiver", "kvtransfer-sender"])
    receiver.expect("r", [0])
    sender.write("r", range(3), [1], [0])
    sender.notify("r", NotifyPayload(1))
    assert receiver.wait("r", timeout_s=10).status is TransferStatus.DONE
    sender.close()
    receiver.close()
    assert _kv_threads() == before
    sender.close()
    receiver.close()
    with pytest.raises(SenderClosed, match="sender closed"):
        sender.write("r2", [0], [0], [0])


def _unread_router() -> tuple[zmq.Context, zmq.Socket, str]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return ctx, sock, f"tcp://127.0.0.1:{port}"


def test_back_pressure_then_close_fails_queued_ops():
    layout = KVLayout("bfloat16", block_size=16, num_layers=1, num_kv_heads=8, head_dim=64)
    ctx, router, address = _unread_router()   # a receiver that never reads
    descriptor = RegionDescriptor(layout, 8, ("tcp",), address, local_host_id(), "x")
    sender = create_sender(descriptor, random_pool(layout, 8, 0), layout, "tcp")
    try:
        futures = [sender.write(f"r{i}", [0], range(8), range(8)) for i in range(400)]  # 100 MiB
        time.sleep(1.0)
        done = sum(f.done() for f in futures)
        assert done < 200, f"{done} writes went out with nobody reading: queues are unbounded"
        t0 = time.monotonic()
        sender.close()
        assert time.monotonic() - t0 < 5
        stuck = [f for f in futures if not f.done() or f.exception() is not None]
        assert stuck and all(isinstance(f.exception(timeout=1), SenderClosed) for f in stuck)
    finally:
        sender.close()
        router.close(linger=0)
        ctx.term()


def test_close_while_receiver_is_gone(layout):
    pool = torch.zeros(layout.pool_shape(4), dtype=torch.bfloat16)
    receiver = create_receiver(pool, layout, "tcp")
    descriptor = receiver.descriptor
    receiver.close()
    sender = create_sender(descriptor, random_pool(layout, 4, 0), layout, "tcp", heartbeat_s=0.05)
    futures = [sender.write("r", [0], [0], [1]) for _ in range(50)]
    t0 = time.monotonic()
    sender.close()
    assert time.monotonic() - t0 < 5
    assert all(f.done() for f in futures)


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
def test_curve_encrypts_and_admits_only_allowed_clients(layout):
    server, client, stranger = CurveKeys.generate(), CurveKeys.generate(), CurveKeys.generate()
    pool = torch.zeros(layout.pool_shape(4), dtype=torch.bfloat16)
    receiver = create_receiver(pool, layout, "tcp", curve=server, allowed_clients=[client.public])
    src = random_pool(layout, 4, 3)
    good = create_sender(receiver.descriptor.to_bytes(), src, layout, "tcp", curve=client)
    bad = create_sender(receiver.descriptor.to_bytes(), src, layout, "tcp", curve=stranger)
    try:
        assert receiver.descriptor.curve_public_key == server.public
        receiver.expect("ok", [0])
        receiver.expect("no", [1], lease_s=0.5)
        bad.write("no", range(3), [2], [1])
        bad.notify("no", NotifyPayload(1))
        good.write("ok", range(3), [1], [0])
        good.notify("ok", NotifyPayload(2))
        assert receiver.wait("ok", timeout_s=10).status is TransferStatus.DONE
        assert receiver.wait("no", timeout_s=5).status is TransferStatus.FAILED
        raw = pool.view(torch.uint8)
        assert torch.equal(raw[:, :, 0], src.view(torch.uint8)[:, :, 1])
        assert torch.count_nonzero(raw[:, :, 1]) == 0
        assert receiver.stats()["accepted"] == 2
    finally:
        good.close()
        bad.close()
        receiver.close()
    assert _kv_threads() == []
