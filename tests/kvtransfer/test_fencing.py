"""Fencing (kvtransfer.tracker ``fence``): after a request moves to a new writer (prefill
failover), the writers so far are refused -- a late tcp write is rejected before a byte lands,
and a late notify, heartbeat or cancel of theirs changes nothing -- and only the new writer's
layers and notify complete the transfer."""
from __future__ import annotations

import pytest
import torch

from kvtransfer import KVLayout, TransferStatus
from kvtransfer.messages import Cancel, Heartbeat, Notify, NotifyPayload, WritePayload, encode
from kvtransfer.receiver import ReceiverCore

LAYOUT = KVLayout("bfloat16", block_size=2, num_layers=2, num_kv_heads=1, head_dim=4)  # 16 B/block
BLOCKS = (2, 3)
POISON = 0x5A


def core() -> ReceiverCore:
    pool = torch.empty(LAYOUT.pool_shape(8), dtype=torch.bfloat16)
    pool.view(torch.uint8).fill_(POISON)
    c = ReceiverCore(pool, LAYOUT, ("tcp",))
    c.table.expect("r", BLOCKS, num_layers=2, lease_s=60)
    return c


def write(c: ReceiverCore, peer: bytes, layer: int, byte: int):
    frame = bytes([byte]) * (16 * len(BLOCKS))
    return c.handle(peer, [encode(WritePayload("r", (layer,), BLOCKS)), frame, frame])


def layer_bytes(c: ReceiverCore, layer: int) -> set[int]:
    return set(c.pool.view(torch.uint8)[layer, :, list(BLOCKS)].flatten().tolist())


def test_a_fenced_writer_is_refused_and_its_late_bytes_never_land():
    c = core()
    assert write(c, b"old", 0, 0x11) == []
    assert c.table.fence("r") == [b"old"]
    res = c.table.result("r")
    assert res.status is TransferStatus.WAITING and res.landed_layers == ()   # nothing counts any more

    assert write(c, b"old", 1, 0x66) == [(b"old", Cancel("r", "fenced_writer"))]
    assert layer_bytes(c, 1) == {POISON}                                       # rejected before landing
    assert c.handle(b"old", [encode(Notify("r", NotifyPayload(first_token_id=9)))]) == [
        (b"old", Cancel("r", "fenced_writer"))]
    assert c.handle(b"old", [encode(Heartbeat(("r",)))]) == [(b"old", Cancel("r", "not active"))]
    c.handle(b"old", [encode(Cancel("r", "giving up"))])
    assert c.table.result("r").status is TransferStatus.WAITING                # not cancelled by the old writer
    assert c.counters["rejected_fenced_writer"] == 2

    for layer in (0, 1):
        assert write(c, b"new", layer, 0x22) == []
    c.handle(b"new", [encode(Notify("r", NotifyPayload(first_token_id=7)))])
    res = c.table.result("r")
    assert res.status is TransferStatus.DONE and res.payload.first_token_id == 7
    assert layer_bytes(c, 0) == layer_bytes(c, 1) == {0x22}


def test_only_an_unfinished_request_can_be_fenced():
    c = core()
    for layer in (0, 1):
        write(c, b"old", layer, 0x11)
    c.handle(b"old", [encode(Notify("r", NotifyPayload(first_token_id=7)))])
    with pytest.raises(ValueError, match="is done"):
        c.table.fence("r")
