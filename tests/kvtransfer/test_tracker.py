from __future__ import annotations

import pytest

from kvtransfer.messages import MessageError, NotifyPayload
from kvtransfer.tracker import RequestTable, TransferStatus


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(one_sided: bool = True) -> tuple[RequestTable, Clock]:
    clock = Clock()
    return RequestTable(num_blocks=8, max_layers=2, one_sided=one_sided, clock=clock), clock


def test_lifecycle_waiting_transferring_done():
    t, _ = table()
    t.expect("r", [3, 1], num_layers=2, lease_s=5)
    assert t.result("r").status is TransferStatus.WAITING
    req = t.check_write(b"p", "r", (1,), (1,))
    t.mark_landed(b"p", req, (1,), (1,))
    assert t.result("r").status is TransferStatus.TRANSFERRING
    assert t.result("r").landed_layers == ()
    t.mark_landed(b"p", req, (0, 1), (3, 1))
    assert t.result("r").landed_layers == (0, 1)
    assert t.result("r").status is TransferStatus.TRANSFERRING  # no notify yet
    t.notify(b"p", "r", NotifyPayload(5))
    res = t.result("r")
    assert res.status is TransferStatus.DONE and res.blocks_freeable and res.payload.first_token_id == 5
    assert t.finished() == ["r"]
    assert t.release("r") == (3, 1)
    with pytest.raises(KeyError, match="request_id='r' is not tracked"):
        t.result("r")


def test_expect_validation():
    t, _ = table()
    t.expect("a", [0, 1], 2, 1.0)
    with pytest.raises(ValueError, match="already tracked"):
        t.expect("a", [2], 2, 1.0)
    with pytest.raises(ValueError, match="already belong to request_id='a'"):
        t.expect("b", [1, 2], 2, 1.0)
    with pytest.raises(ValueError, match="out of range"):
        t.expect("b", [8], 2, 1.0)
    with pytest.raises(ValueError, match="unique"):
        t.expect("b", [2, 2], 2, 1.0)
    with pytest.raises(ValueError, match="num_layers"):
        t.expect("b", [2], 3, 1.0)
    with pytest.raises(ValueError, match="lease_s"):
        t.expect("b", [2], 2, 0)
    with pytest.raises(ValueError, match="request_id"):
        t.expect("", [2], 2, 1.0)
    t.expect("empty", [], 1, 1.0)  # a fully prefix-cached request still waits for notify
    t.notify(b"p", "empty", NotifyPayload(1))
    assert t.result("empty").status is TransferStatus.DONE


def test_check_write_rejections():
    t, _ = table()
    t.expect("r", [2, 3], 1, 1.0)
    t.expect("s", [4], 2, 1.0)
    cases = [("nope", (0,), (2,), "unknown_request"), ("r", (1,), (2,), "layer_out_of_range"),
             ("r", (), (2,), "layer_out_of_range"), ("r", (0,), (8,), "out_of_range_block"),
             ("r", (0,), (4,), "block_not_in_request")]
    for rid, layers, blocks, reason in cases:
        with pytest.raises(MessageError, match=f"^{reason}: request_id={rid}") as info:
            t.check_write(b"p", rid, layers, blocks)
        assert info.value.reason == reason
    t.cancel("r", "x")
    with pytest.raises(MessageError, match="^inactive_request: request_id=r is cancelled") as info:
        t.check_write(b"p", "r", (0,), (2,))
    assert info.value.reason == "inactive_request"


def test_lease_expires_and_is_renewed_by_activity():
    t, clock = table()
    t.expect("r", [0], 2, lease_s=2.0)
    clock.now += 1.5
    assert t.heartbeat(b"p", ["r", "ghost"]) == ["ghost"]
    clock.now += 1.5
    assert not t.expire()
    assert t.next_deadline() == pytest.approx(103.5)
    clock.now += 0.6
    assert t.expire()
    res = t.result("r")
    assert res.status is TransferStatus.FAILED and res.blocks_freeable
    assert res.reason == "lease expired: no sender activity for 2 s"
    assert t.heartbeat(b"p", ["r"]) == ["r"]


def test_one_sided_cancel_waits_for_every_writer_ack():
    t, clock = table(one_sided=True)
    t.expect("r", [0, 1], 2, lease_s=10.0)
    req = t.check_write(b"p1", "r", (0,), (0,))
    t.mark_landed(b"p1", req, (0,), (0,))
    t.notify(b"p2", "r", NotifyPayload(1))
    assert t.cancel("r", "gone") == [b"p1", b"p2"]
    res = t.result("r")
    assert res.status is TransferStatus.CANCELLED and not res.blocks_freeable
    assert t.finished() == []
    with pytest.raises(ValueError, match="may still be written"):
        t.release("r")
    t.acked(b"p1", "r")
    assert not t.result("r").blocks_freeable
    t.acked(b"p2", "r")
    assert t.result("r").blocks_freeable
    assert t.cancel("r", "again") == []  # idempotent


def test_one_sided_cancel_without_known_writer_frees_after_lease():
    t, clock = table(one_sided=True)
    t.expect("r", [0], 2, lease_s=3.0)
    assert t.cancel("r", "gone") == []
    clock.now += 2.9
    t.expire()
    assert not t.result("r").blocks_freeable
    clock.now += 0.2
    assert t.expire()
    assert t.result("r").blocks_freeable and t.result("r").status is TransferStatus.CANCELLED


def test_two_sided_cancel_frees_at_once():
    t, _ = table(one_sided=False)
    t.expect("r", [0], 2, 3.0)
    t.notify(b"p", "r", NotifyPayload(1))
    assert t.cancel("r", "gone") == []
    assert t.result("r").blocks_freeable


def test_sender_cancel_frees_at_once():
    t, _ = table(one_sided=True)
    t.expect("r", [0], 2, 3.0)
    t.cancelled_by_sender(b"p", "r", "aborted")
    res = t.result("r")
    assert res.status is TransferStatus.CANCELLED and res.blocks_freeable
    assert res.reason == "cancelled by sender: aborted"
    with pytest.raises(MessageError, match="^unknown_request: request_id=ghost"):
        t.cancelled_by_sender(b"p", "ghost", "x")
