"""Tests for kvtransfer.join_descriptors / split_descriptors: one TP replica's regions in one blob."""
from __future__ import annotations

import msgpack
import pytest

import kvtransfer
from kvtransfer import KVLayout, MessageError, RegionDescriptor


def _descriptor(tp_rank: int) -> bytes:
    layout = KVLayout("float32", 16, 2, 1, 16, tp_rank)
    return RegionDescriptor(layout, 64, ("shm", "tcp"), f"tcp://127.0.0.1:{5000 + tp_rank}", "host/boot",
                            f"region-{tp_rank}", f"/dev/shm/tandem-kv-1-{tp_rank}").to_bytes()


def test_one_rank_is_the_plain_descriptor():
    one = _descriptor(0)
    assert kvtransfer.join_descriptors([one]) == one
    assert kvtransfer.split_descriptors(one) == [one]


def test_ranks_round_trip_in_order():
    per_rank = [_descriptor(r) for r in range(4)]
    blob = kvtransfer.join_descriptors(per_rank)
    assert kvtransfer.split_descriptors(blob) == per_rank
    assert [RegionDescriptor.from_bytes(d).layout.tp_rank for d in kvtransfer.split_descriptors(blob)] == [0, 1, 2, 3]


@pytest.mark.parametrize("blob, message", [
    (msgpack.packb(["tp", [b"x"]]), "bad_field: descriptor set"),            # a set of one rank
    (msgpack.packb(["tp", [b"x", "not bytes"]]), "bad_field: descriptor set"),
    (msgpack.packb(["tp", [b"x"] * 65]), "malformed: descriptor"),            # more ranks than any replica has
    (b"\xc1", "malformed: descriptor"),                                       # not msgpack
])
def test_bad_sets_are_refused(blob, message):
    with pytest.raises(MessageError, match=f"^{message}"):
        kvtransfer.split_descriptors(blob)
