"""The tcp data plane's frame bound: no payload frame longer than ``max_frame_nbytes``.

A sender splits a write whose blocks do not fit one frame over several messages (the data still
lands bit-exact); a receiver drops a peer that sends a longer frame before it is buffered whole,
and a frame that names more blocks than the bound is rejected where zmq let it through (zmq's
limit is per frame and at least a header's ``MAX_HEADER_BYTES``).
The bound is shrunk here (``MAX_FRAME_NBYTES`` = 2 blocks) so tiny pools exercise it.
"""
from __future__ import annotations

import time

import pytest
import torch
import zmq

from kvtransfer import KVLayout, NotifyPayload, TransferStatus, create_receiver, create_sender, messages
from kvtransfer.messages import WritePayload, encode
from kvtransfer.receiver import ReceiverCore

from .conftest import make_pair, random_pool

pytestmark = pytest.mark.timeout(60)

BLOCKS_PER_FRAME = 2


@pytest.fixture
def small_frames(monkeypatch: pytest.MonkeyPatch, layout: KVLayout) -> int:
    cap = BLOCKS_PER_FRAME * layout.block_nbytes
    monkeypatch.setattr(messages, "MAX_FRAME_NBYTES", cap)
    return cap


@pytest.mark.parametrize("src_ids", [[0, 1, 2, 3, 4, 5, 6], [7, 2, 3, 11, 0, 9, 5]],
                         ids=["contiguous", "scattered"])
def test_a_write_longer_than_a_frame_is_split_and_lands_exact(small_frames, layout, src_ids):
    pair = make_pair("tcp", layout)
    try:
        sent: list[list] = []
        sender = pair.sender()
        inner = sender._writer.write

        def spy(send, ctx, request_id, layers, src, dst):
            def recording_send(frames, **kw):
                sent.append([len(memoryview(f).cast("B")) for f in frames[1:]])
                return send(frames, **kw)
            return inner(recording_send, ctx, request_id, layers, src, dst)

        sender._writer.write = spy
        dst_ids = [9, 4, 5, 0, 1, 2, 15]
        pair.receiver.expect("r", dst_ids)
        sender.write("r", range(3), src_ids, dst_ids).result(timeout=10)
        sender.notify("r", NotifyPayload(first_token_id=1)).result(timeout=10)
        assert pair.receiver.wait("r", timeout_s=10).status is TransferStatus.DONE
        pair.land(range(3), src_ids, dst_ids)
        pair.assert_pool()
        assert pair.receiver.stats().get("rejected", 0) == 0
        frame_sizes = [n for message in sent for n in message]
        assert max(frame_sizes) <= small_frames
        assert sum(frame_sizes) == 3 * 2 * len(dst_ids) * layout.block_nbytes
    finally:
        pair.close()


def test_a_frame_over_the_bound_is_rejected_by_the_core(small_frames, layout):
    pool = torch.zeros(layout.pool_shape(8), dtype=layout.torch_dtype)
    core = ReceiverCore(pool, layout, ["tcp"])
    core.table.expect("r", (0, 1, 2), num_layers=1, lease_s=5)
    frame = b"\x07" * (3 * layout.block_nbytes)
    assert core.handle(b"peer", [encode(WritePayload("r", (0,), (0, 1, 2))), frame, frame]) == []
    assert core.counters["rejected_frame_size"] == 1
    assert torch.count_nonzero(pool.view(torch.uint8)) == 0


def test_a_peer_sending_a_frame_over_the_bound_is_dropped_and_others_still_served(small_frames, layout):
    pair = make_pair("tcp", layout)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        rogue.connect(pair.receiver.descriptor.address)
        pair.receiver.expect("big", (0, 1, 2, 3), num_layers=1)
        huge = b"\x07" * (4 * layout.block_nbytes)     # honest size for 4 blocks, over the bound
        rogue.send_multipart([encode(WritePayload("big", (0,), (0, 1, 2, 3))), huge, huge])
        # An honest sender is still served, and the rogue frame never reached the pool.
        sender = pair.sender()
        pair.receiver.expect("ok", [8, 9], num_layers=3)
        sender.write("ok", range(3), [0, 1], [8, 9]).result(timeout=10)
        sender.notify("ok", NotifyPayload(first_token_id=1)).result(timeout=10)
        assert pair.receiver.wait("ok", timeout_s=10).status is TransferStatus.DONE
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and pair.receiver.stats().get("accepted", 0) < 3:
            time.sleep(0.05)
        stats = pair.receiver.stats()
        # Dropped by zmq (a frame over MAXMSGSIZE) or refused by the core (the bound is below
        # MAX_HEADER_BYTES here): either way it never counts as accepted.
        assert stats.get("rejected", 0) == stats.get("rejected_frame_size", 0) <= 1, stats
        assert stats["accepted"] == 2, stats             # the honest write and its notify only
        raw = pair.dst.view(torch.uint8)
        assert not bool((raw[0, :, 0:4] == 7).all())
    finally:
        rogue.close(linger=0)
        ctx.term()
        pair.close()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
@pytest.mark.parametrize("secret", [None, "frame-bound-test-secret"], ids=["plain", "curve"])
def test_frames_of_exactly_the_real_bound_land_with_and_without_curve(secret):
    # The real bound (4 MiB), not a shrunk one: 16 blocks of 256 KiB fill one frame exactly, and
    # zmq sees it with CurveZMQ's box around it, which must still fit.
    layout = KVLayout("float32", block_size=64, num_layers=1, num_kv_heads=8, head_dim=128)
    assert messages.max_frame_nbytes(layout.block_nbytes) == 16 * layout.block_nbytes
    dst = torch.zeros(layout.pool_shape(40), dtype=torch.float32)
    receiver = create_receiver(dst, layout, "tcp", secret=secret)
    src = random_pool(layout, 40, seed=7)
    sender = create_sender(receiver.descriptor.to_bytes(), src, layout, "tcp", secret=secret)
    try:
        src_ids, dst_ids = list(range(3, 37)), list(range(4, 38))   # 34 blocks: 16 + 16 + 2
        receiver.expect("r", dst_ids)
        sender.write("r", [0], src_ids, dst_ids).result(timeout=20)
        sender.notify("r", NotifyPayload(first_token_id=1)).result(timeout=20)
        assert receiver.wait("r", timeout_s=20).status is TransferStatus.DONE
        assert torch.equal(dst.view(torch.uint8)[:, :, dst_ids], src.view(torch.uint8)[:, :, src_ids])
        assert receiver.stats().get("rejected", 0) == 0
    finally:
        sender.close()
        receiver.close()
