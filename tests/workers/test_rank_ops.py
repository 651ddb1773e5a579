"""The TP mirrored ops of both roles (prefill_worker/ops.py, decode_worker/ops.py) through the
wire form worker/tp_role.py sends them in: msgpack as engine/tp/group.py packs it, decoded
only into the receiving role's op types, each field checked."""
from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest

from decode_worker import ops as decode_ops
from decode_worker.ranks import DecodeRank
from engine.tp.group import OPS
from kvtransfer.messages import NotifyPayload
from prefill_worker import ops as prefill_ops
from prefill_worker.ranks import PrefillRank
from worker.tp_role import MirroredOp, MirroredOps, RoleHandler

PREFILL = [
    prefill_ops.Open("r1", b"\x00region\xff", [4, 5, 6]),
    prefill_ops.Write("r1", [0, 1], [0, 1, 2], [4, 5, 6]),
    prefill_ops.Notify("r1", NotifyPayload(first_token_id=17, first_logprob=-0.25,
                                           top_logprobs=((17, -0.25), (3, -1.5)), num_prompt_tokens=9,
                                           num_cached_tokens=4)),
    prefill_ops.Notify("r2", NotifyPayload(first_token_id=0)),
    prefill_ops.Cancel("r1", "aborted at the prefill worker"),
    prefill_ops.CancelAt(b"blob", "r3", "aborted"),
    prefill_ops.Forget("r1"),
    prefill_ops.Poll(["r1", "r2"]),
    prefill_ops.Poll([]),
]
DECODE = [
    decode_ops.Expect("r1", [7, 8], 30, 10.0),
    decode_ops.Cancel("r1", "aborted at the decode worker"),
    decode_ops.Release("r1"),
    decode_ops.Fence("r1", "moved to prefill worker 127.0.0.1:5"),
    decode_ops.Poll(["r1"]),
]


def through_msgpack(body: Any) -> Any:
    """What a follower's TPGroup.receive returns for what rank 0's TPGroup.send packed."""
    return msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False, strict_map_key=False)


@pytest.mark.parametrize("handler_type, ops", [(PrefillRank, PREFILL), (DecodeRank, DECODE)])
def test_every_op_round_trips_through_msgpack(handler_type, ops):
    assert handler_type.decode(through_msgpack([op.to_wire() for op in ops])) == ops
    assert {type(op) for op in ops} == set(handler_type.OP_TYPES)   # every op type is covered


def test_the_wire_form_is_tag_then_fields():
    assert prefill_ops.Open("r1", b"d", [1, 2]).to_wire() == ["open", "r1", b"d", [1, 2]]
    assert decode_ops.Expect("r1", [3], 2, 5.0).to_wire() == ["expect", "r1", [3], 2, 5.0]
    assert prefill_ops.Notify("r1", NotifyPayload(5, -1.0, ((5, -1.0),), 3, 1)).to_wire() == \
        ["notify", "r1", [5, -1.0, [[5, -1.0]], 3, 1]]


@pytest.mark.parametrize("module", [prefill_ops, decode_ops])
def test_tags_are_unique_within_a_role(module):
    tags = [t.TAG for t in module.OP_TYPES]
    assert len(set(tags)) == len(tags) and "" not in tags


@pytest.mark.parametrize("wire, match", [
    ([["expect", "r1", [1], 2, 5.0]], "unknown PrefillRank op"),      # the other role's op
    ([["open", "r1", b"d"]], "'open' op has 3 fields"),                 # a field missing
    ([["open", "r1", "not bytes", [1]]], "field descriptors is not a bytes"),
    ([["write", "r1", [0], [1, "2"], [3, 4]]], "field src_block_ids is not a list"),
    ([["write", "r1", [0], [True], [3]]], "field src_block_ids is not a list"),
    ([["poll", "r1"]], "field request_ids is not a list"),
    ([["notify", "r1", [5, None, [[5]], 3, 1]]], "malformed 'notify' op top logprobs"),
    ([["notify", "r1", [5, "x", [], 3, 1]]], "malformed 'notify' op payload"),
    ([[]], "unknown PrefillRank op"),
    ({"ops": []}, "arrive as a list"),
])
def test_a_follower_refuses_malformed_ops(wire, match):
    with pytest.raises(ValueError, match=match):
        PrefillRank.decode(through_msgpack(wire))


def test_decode_refuses_a_prefill_op():
    with pytest.raises(ValueError, match="unknown DecodeRank op"):
        DecodeRank.decode([prefill_ops.Forget("r1").to_wire()])


class Recording(RoleHandler):
    OP_TYPES = decode_ops.OP_TYPES

    def __init__(self, reply: list[int]) -> None:
        self.applied: list[list[MirroredOp]] = []
        self.reply = reply

    def apply(self, ops: list[MirroredOp]) -> list[int]:
        self.applied.append(ops)
        return self.reply


class FakeGroup:
    def __init__(self, follower_handler: Recording) -> None:
        self.follower = follower_handler
        self.replies: list[list[int]] = []

    def send(self, kind: int, body: Any) -> None:
        assert kind == OPS
        body = through_msgpack(body)
        self.replies.append(self.follower.apply(self.follower.decode(body["ops"])))

    def all_min(self, values: list[int]) -> list[int]:
        return [min(a, b) for a, b in zip(values, self.replies[-1], strict=True)]


class FakeLeader:
    def __init__(self, group: FakeGroup) -> None:
        self.group = group

    @contextlib.contextmanager
    def transaction(self):
        yield self.group


def test_mirrored_ops_apply_here_then_send_the_same_ops_to_followers():
    here, there = Recording([1, 1, 1]), Recording([1, 0, 1])
    mirrored = MirroredOps(here, FakeLeader(FakeGroup(there)))  # type: ignore[arg-type]
    ops = [decode_ops.Expect("r1", [7, 8], 30, 10.0), decode_ops.Poll(["r1"])]
    assert mirrored.run(ops, reply=True) == [1, 0, 1]
    assert here.applied == [ops] and there.applied == [ops]
    assert MirroredOps(here, None).run([decode_ops.Release("r1")]) == [1, 1, 1]


def test_a_poll_reply_min_reduced_over_the_ranks_is_the_replicas_answer():
    # Decode: one rank's failed transfer fails the request at once; done only when every rank is.
    assert min(decode_ops.ReceivePoll.FAILED, decode_ops.ReceivePoll.IN_FLIGHT) is decode_ops.ReceivePoll.FAILED
    assert min(decode_ops.ReceivePoll.DONE, decode_ops.ReceivePoll.IN_FLIGHT) is decode_ops.ReceivePoll.IN_FLIGHT
    # Prefill: a failure ends the request only once no rank's op can still read its source blocks.
    assert min(prefill_ops.SendPoll.FAILED, prefill_ops.SendPoll.IN_FLIGHT) is prefill_ops.SendPoll.IN_FLIGHT
    assert min(prefill_ops.SendPoll.FAILED, prefill_ops.SendPoll.DONE) is prefill_ops.SendPoll.FAILED
