"""The workers' internal decoders answer random and mutated input with their own error type,
never another exception (hypothesis): the TP ops rank 0 mirrors to its followers (msgpack,
``RoleHandler.decode``: ValueError) and the protobuf messages of worker.proto and admin.proto
(``DecodeError``)."""
from __future__ import annotations

import msgpack
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtransfer
from decode_worker import ops as decode_ops
from decode_worker.ranks import DecodeRank
from prefill_worker import ops as prefill_ops
from prefill_worker.ranks import PrefillRank
from protos.tandem.v1 import admin_pb2, worker_pb2

FUZZ = settings(max_examples=300, deadline=None, derandomize=True)
leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                   st.text(max_size=8), st.binary(max_size=8))
trees = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                      st.dictionaries(st.text(max_size=3), inner, max_size=3)),
                     max_leaves=20)
VALID_OPS = {
    PrefillRank: [prefill_ops.Open("r", b"d", [1, 2]), prefill_ops.Write("r", [0], [1], [2]),
                  prefill_ops.Notify("r", kvtransfer.NotifyPayload(5, -0.25, ((5, -0.25),), 9, 0)),
                  prefill_ops.Cancel("r", "x"), prefill_ops.CancelAt(b"d", "r", "x"), prefill_ops.Forget("r"),
                  prefill_ops.Poll(["r"])],
    DecodeRank: [decode_ops.Expect("r", [1, 2], 3, 30.0), decode_ops.Cancel("r", "x"), decode_ops.Release("r"),
                 decode_ops.Fence("r", "x"), decode_ops.Poll(["r"])],
}


def _through_msgpack(value):
    return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False, strict_map_key=False)


def _decodes_or_value_error(role, wire) -> None:
    try:
        role.decode(wire)
    except ValueError:
        pass


@FUZZ
@given(st.sampled_from(sorted(VALID_OPS, key=str)), st.data())
def test_mutated_ops(role, data):
    op = data.draw(st.sampled_from(VALID_OPS[role]))
    wire = _through_msgpack(op.to_wire())
    assert role.decode([wire]) == [op]
    for _ in range(data.draw(st.integers(1, 3))):   # replace a field, or something inside one
        i = data.draw(st.integers(1, len(wire) - 1))
        if isinstance(wire[i], list) and wire[i] and data.draw(st.booleans()):
            wire[i][data.draw(st.integers(0, len(wire[i]) - 1))] = data.draw(trees)
        else:
            wire[i] = data.draw(trees)
    _decodes_or_value_error(role, [_through_msgpack(wire)])


@FUZZ
@given(st.sampled_from([PrefillRank, DecodeRank]), trees)
def test_random_ops(role, tree):
    _decodes_or_value_error(role, _through_msgpack(tree))
    _decodes_or_value_error(role, [_through_msgpack(tree)])


MESSAGES = sorted([*worker_pb2.DESCRIPTOR.message_types_by_name.values(),
                   *admin_pb2.DESCRIPTOR.message_types_by_name.values()], key=lambda d: d.full_name)


@FUZZ
@given(st.sampled_from(MESSAGES), st.binary(max_size=512))
def test_random_protobuf(descriptor, data):
    cls = (worker_pb2 if descriptor.file is worker_pb2.DESCRIPTOR else admin_pb2).__dict__[descriptor.name]
    try:
        cls.FromString(data)
    except DecodeError:
        pass


def test_notify_op_top_logprobs_are_checked():
    for top in ([[float("inf"), 0.0]], [[1, 10**400]], [["1", 0.0]], [[1.5, 0.0]], [[-3, 0.0]], [[1]], [None]):
        wire = ["notify", "r", [1, None, top, 1, 0]]
        try:
            PrefillRank.decode([wire])
        except ValueError as exc:
            assert "malformed 'notify' op top logprobs" in str(exc)
        else:
            raise AssertionError(f"{top} decoded")
    [op] = PrefillRank.decode([["notify", "r", [1, None, [[4, -1.0]], 1, 0]]])
    assert op.payload.top_logprobs == ((4, -1.0),)
