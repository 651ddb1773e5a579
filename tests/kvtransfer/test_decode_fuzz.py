"""Every msgpack decoder of kvtransfer's wire (messages.decode, RegionDescriptor.from_bytes,
split_descriptors) answers random and mutated bytes with its own MessageError, never another
exception type (hypothesis)."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer import KVLayout
from kvtransfer.descriptor import NixlRegion, RegionDescriptor, join_descriptors, split_descriptors
from kvtransfer.messages import (
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

FUZZ = settings(max_examples=300, deadline=None, derandomize=True)
LAYOUT = KVLayout("bfloat16", block_size=2, num_layers=3, num_kv_heads=1, head_dim=4)
VALID_MESSAGES = [encode(m) for m in (
    WritePayload("r", (0, 1), (2, 3)), WriteDone("r", (2,), (5,)), Cancel("r", "why"), CancelAck("r"),
    Heartbeat(("a", "b")), Notify("r", NotifyPayload(7, -0.5, ((7, -0.5), (8, -1.5)), 12, 4)))]
# msgpack values of every kind, nested: what a peer can put where a field belongs.
leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                   st.text(max_size=8), st.binary(max_size=8))
trees = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                      st.dictionaries(st.text(max_size=3), inner, max_size=3)),
                     max_leaves=20)


def _mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for pos, byte in edits:
        out[pos % len(out)] = byte
    return bytes(out[:cut] if cut is not None else out)


def _decodes_or_message_error(fn, data: bytes) -> None:
    try:
        fn(data)
    except MessageError:
        pass


edits = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=6)
cuts = st.one_of(st.none(), st.integers(0, 64))


@FUZZ
@given(st.sampled_from(VALID_MESSAGES), edits, cuts)
def test_mutated_messages(data, edit, cut):
    _decodes_or_message_error(decode, _mutate(data, edit, cut))


@FUZZ
@given(st.one_of(st.binary(max_size=256), trees.map(lambda t: msgpack.packb(t, use_bin_type=True)),
                 st.builds(lambda tag, body: msgpack.packb([tag, *body], use_bin_type=True),
                           st.integers(0, 7), st.lists(trees, max_size=7))))
def test_random_messages(data):
    _decodes_or_message_error(decode, data)


def _descriptor(nixl: bool = False) -> bytes:
    region = NixlRegion(bytes(range(200)), 1 << 40, 0, "DRAM") if nixl else None
    return RegionDescriptor(layout=LAYOUT, num_blocks=8, transports=("nixl",) if nixl else ("tcp",),
                            address="tcp://127.0.0.1:5555", host_id="h", region_id="region", nixl=region).to_bytes()


@FUZZ
@given(edits, cuts, st.booleans(), st.booleans())
def test_mutated_descriptors(edit, cut, as_set, nixl):
    data = join_descriptors([_descriptor(nixl), _descriptor()]) if as_set else _descriptor(nixl)
    _decodes_or_message_error(split_descriptors if as_set else RegionDescriptor.from_bytes, _mutate(data, edit, cut))


@FUZZ
@given(st.one_of(st.binary(max_size=256), trees.map(lambda t: msgpack.packb(t, use_bin_type=True))))
def test_random_descriptors(data):
    _decodes_or_message_error(RegionDescriptor.from_bytes, data)
    _decodes_or_message_error(split_descriptors, data)


def test_valid_messages_round_trip():
    for data in VALID_MESSAGES:
        assert encode(decode(data)) == data
    assert split_descriptors(join_descriptors([_descriptor()])) == [_descriptor()]
    assert RegionDescriptor.from_bytes(_descriptor(nixl=True)).to_bytes() == _descriptor(nixl=True)
    with pytest.raises(MessageError):
        decode(b"\xc1")
