from __future__ import annotations

import math

import msgpack
import pytest

from kvtransfer.descriptor import CudaIpcHandle, RegionDescriptor
from kvtransfer.layout import KVLayout
from kvtransfer.messages import (
    MAX_BLOCK_IDS,
    MAX_HEADER_BYTES,
    Cancel,
    CancelAck,
    Heartbeat,
    MessageError,
    Notify,
    NotifyPayload,
    WriteDone,
    WritePayload,
    decode,
    encode,
)

MESSAGES = [
    WritePayload("req-1", (0, 2), (5, 6, 2**63 - 1)),
    WritePayload("r", (1,), ()),
    WriteDone("req-é", (0, 1, 2), (9,)),
    Notify("req-1", NotifyPayload(17)),
    Notify("req-1", NotifyPayload(17, -0.25, ((17, -0.25), (4, -math.inf)), 100, 64)),
    Cancel("req-1", "client gone"),
    Cancel("req-1"),
    CancelAck("req-1"),
    Heartbeat(("a", "b")),
    Heartbeat(()),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_every_type_has_a_round_trip_case():
    assert {type(m) for m in MESSAGES} == {WritePayload, WriteDone, Notify, Cancel, CancelAck, Heartbeat}


def test_wire_format_is_a_tagged_array():
    assert msgpack.unpackb(encode(WriteDone("r", (1,), (2, 3)))) == [2, "r", [1], [2, 3]]
    assert msgpack.unpackb(encode(CancelAck("r"))) == [5, "r"]


def _raw(*obj) -> bytes:
    return msgpack.packb(list(obj), use_bin_type=True)


@pytest.mark.parametrize("data, reason", [
    (b"", "malformed"),
    (b"\xc1", "malformed"),
    (_raw(), "malformed"),
    (msgpack.packb({"tag": 1}), "malformed"),
    (_raw(99, "r"), "unknown_type"),
    (_raw("1", "r"), "malformed"),
    (_raw(5), "bad_field"),
    (_raw(5, "r", "extra"), "bad_field"),
    (_raw(5, ""), "bad_field"),
    (_raw(5, "x" * 257), "bad_field"),
    (_raw(5, b"bytes-id"), "malformed"),          # bin is not allowed at all
    (_raw(2, "r", [0], [-1]), "bad_field"),
    (_raw(2, "r", [0], [True]), "bad_field"),
    (_raw(2, "r", [0], [1.0]), "bad_field"),
    (_raw(2, "r", [0, 0], [1]), "bad_field"),
    (_raw(2, "r", [0], [1, 1]), "bad_field"),
    (_raw(2, "r", [0], 3), "bad_field"),
    (_raw(2, "r", list(range(1025)), [1]), "bad_field"),
    (_raw(2, "r", [0], list(range(MAX_BLOCK_IDS + 1))), "malformed"),
    (_raw(3, "r", 1, math.nan, [], 0, 0), "bad_field"),
    (_raw(3, "r", 1, None, [[1, 2]], 0, 0), "bad_field"),
    (_raw(3, "r", 1, None, [[1, -1.0]] * 65, 0, 0), "bad_field"),
    (_raw(3, "r", -1, None, [], 0, 0), "bad_field"),
    (_raw(4, "r", "x" * 1025), "malformed"),
    (_raw(6, ["r"] * 4097), "bad_field"),
    (b"\x00" * (MAX_HEADER_BYTES + 1), "oversize"),
])
def test_rejects(data, reason):
    with pytest.raises(MessageError, match=f"^{reason}") as info:
        decode(data)
    assert info.value.reason == reason


def test_encode_refuses_what_decode_would_reject():
    with pytest.raises(MessageError, match="^bad_field: request_id$"):
        encode(Cancel("x" * 300))
    with pytest.raises(MessageError, match="^bad_field: top_logprobs$"):
        encode(Notify("r", NotifyPayload(1, top_logprobs=tuple((i, -1.0) for i in range(65)))))


def _descriptor(**kw) -> RegionDescriptor:
    base = dict(layout=KVLayout("bfloat16", 16, 30, 3, 64, tp_rank=1), num_blocks=512,
                transports=("shm", "tcp"), address="tcp://127.0.0.1:5555", host_id="h/boot",
                region_id="abc", shm_path="/dev/shm/pool")
    return RegionDescriptor(**{**base, **kw})


def test_descriptor_round_trip():
    d = _descriptor()
    assert RegionDescriptor.from_bytes(d.to_bytes()) == d
    cuda = CudaIpcHandle(0, b"\x01" * 64, 1 << 20, 0, b"ref", 8, b"\x02" * 64, True, 0)
    d2 = _descriptor(transports=("cuda-ipc", "tcp"), shm_path=None, cuda_ipc=cuda,
                     curve_public_key=b"x" * 40)
    assert RegionDescriptor.from_bytes(d2.to_bytes()) == d2


@pytest.mark.parametrize("kw, message", [
    (dict(transports=("rdma",)), "transports"), (dict(num_blocks=0), "num_blocks"),
    (dict(curve_public_key=b"short"), "curve_public_key"), (dict(layout=None), "layout: dtype='float64")])
def test_descriptor_rejects(kw, message):
    if "layout" in kw:
        data = _descriptor().to_bytes().replace(b"bfloat16", b"float64\x00")
    else:
        data = _descriptor(**kw).to_bytes()
    with pytest.raises(MessageError, match=f"^bad_field: {message}"):
        RegionDescriptor.from_bytes(data)
    with pytest.raises(MessageError, match="^malformed: descriptor shape or version"):
        RegionDescriptor.from_bytes(b"\x93\x01\x02\x03")
