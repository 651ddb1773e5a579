"""Property-based fuzzing of the receiver with malformed frames (hypothesis).

Whatever arrives, the receiver must not raise, must not write a byte outside the one request
it expects (blocks 2, 3, 5; layers 0 and 1 of 3), and must still accept a valid write after.
"""
from __future__ import annotations

import msgpack
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtransfer import KVLayout, TransferStatus, create_receiver
from kvtransfer.messages import NotifyPayload, WritePayload, encode
from kvtransfer.receiver import ReceiverCore

LAYOUT = KVLayout("bfloat16", block_size=2, num_layers=3, num_kv_heads=1, head_dim=4)  # 16 B/block
NUM_BLOCKS = 8
REQ_BLOCKS = (2, 3, 5)
POISON = 0x5A

wire_ints = st.integers(-2**63, 2**64 - 1)  # what msgpack can carry at all
ids = st.one_of(st.integers(-2, 12), st.integers(-2**63, 2**64 - 1), st.booleans(), st.none(),
                st.floats(allow_nan=True), st.text(max_size=3))
id_lists = st.lists(ids, max_size=6)
request_ids = st.one_of(st.sampled_from(["r", "other", ""]), st.text(max_size=4), wire_ints)
fields = st.one_of(ids, id_lists, request_ids, st.binary(max_size=8),
                   st.lists(st.lists(ids, max_size=3), max_size=3))
headers = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda tag, body: msgpack.packb([tag, *body], use_bin_type=True),
              st.one_of(st.integers(0, 8), wire_ints, st.text(max_size=2)),
              st.lists(fields, max_size=7)),
    st.builds(lambda tag, rid, layers, blocks: msgpack.packb([tag, rid, layers, blocks]),
              st.sampled_from([1, 2]), request_ids, id_lists, id_lists),
)
payload_frames = st.lists(st.one_of(st.binary(max_size=64), st.sampled_from([b"\x11" * 16,
                                                                           b"\x22" * 32,
                                                                           b"\x33" * 48])),
                          max_size=7)


def _core() -> ReceiverCore:
    pool = torch.empty(LAYOUT.pool_shape(NUM_BLOCKS), dtype=torch.bfloat16)
    pool.view(torch.uint8).fill_(POISON)
    core = ReceiverCore(pool, LAYOUT, ("tcp", "shm"))
    core.table.expect("r", REQ_BLOCKS, num_layers=2, lease_s=60)
    return core


def _outside_untouched(core: ReceiverCore) -> bool:
    raw = core.pool.view(torch.uint8).clone()
    raw[:2, :, list(REQ_BLOCKS)] = POISON  # the only bytes a write may change
    return bool((raw == POISON).all())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(st.tuples(headers, payload_frames), min_size=1, max_size=4))
def test_receiver_survives_garbage_and_writes_only_named_blocks(messages):
    core = _core()
    for header, payload in messages:
        replies = core.handle(b"peer", [header, *payload])
        assert isinstance(replies, list)
    assert _outside_untouched(core)
    counted = sum(v for k, v in core.counters.items() if k in ("accepted", "rejected"))
    assert counted == len(messages)
    # Still serving: a well-formed write for a fresh request lands.
    core.table.expect("fresh", (7,), num_layers=1, lease_s=60)
    core.handle(b"peer", [encode(WritePayload("fresh", (0,), (7,))), b"\x77" * 16, b"\x88" * 16])
    assert core.table.result("fresh").landed_layers == (0,)


@settings(max_examples=150, deadline=None)
@given(layers=id_lists, blocks=id_lists, frames=payload_frames)
def test_structured_writes_validated_before_any_byte(layers, blocks, frames):
    core = _core()
    header = msgpack.packb([1, "r", layers, blocks])
    core.handle(b"peer", [header, *frames])
    assert _outside_untouched(core)
    if core.counters["accepted"]:
        # Only a fully valid write is accepted, and then exactly its frames landed.
        assert len(frames) == 2 * len(layers) and all(len(f) == 16 * len(blocks) for f in frames)
        raw = core.pool.view(torch.uint8)
        for i, layer in enumerate(layers):
            for kv in (0, 1):
                for j, b in enumerate(blocks):
                    assert raw[layer, kv, b].flatten().tolist() == list(frames[2 * i + kv][16 * j:16 * (j + 1)])


def test_garbage_over_a_real_socket_keeps_the_receiver_serving():
    pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS), dtype=torch.bfloat16)
    receiver = create_receiver(pool, LAYOUT, "tcp")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(receiver.descriptor.address)
        receiver.expect("r", (1,), num_layers=3)
        sock.send_multipart([b"\xff\x00garbage"])
        sock.send_multipart([encode(WritePayload("r", (0,), (1,))), b"short", b"\x02" * 16])
        sock.send_multipart([encode(WritePayload("r", (0,), (6,))), b"\x01" * 16, b"\x02" * 16])
        sock.send_multipart([encode(WritePayload("r", (0,), (1,))), b"\x01" * 16])      # truncated
        sock.send_multipart([encode(WritePayload("r", (0,), (1,))), b"\x01" * 16, b"\x02" * 16,
                             b"\x03" * 16])                                               # extra
        sock.send(b"")
        sock.send_multipart([encode(WritePayload("r", (0, 1, 2), (1,))),
                             *[bytes([i]) * 16 for i in range(6)]])
        from kvtransfer.messages import Notify
        sock.send_multipart([encode(Notify("r", NotifyPayload(3)))])
        assert receiver.wait("r", timeout_s=10).status is TransferStatus.DONE
        stats = receiver.stats()
        assert stats["rejected"] == 6 and stats["accepted"] == 2
        assert stats["rejected_malformed"] == 2          # garbage and the empty frame
        assert stats["rejected_frame_size"] == 1
        assert stats["rejected_block_not_in_request"] == 1
        assert stats["rejected_frame_count"] == 2
        raw = pool.view(torch.uint8)
        assert raw[2, 1, 1].flatten().tolist() == [5] * 16
        assert torch.count_nonzero(raw[:, :, 6]) == 0
    finally:
        sock.close(linger=0)
        ctx.term()
        receiver.close()
