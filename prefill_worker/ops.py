"""The ops a prefill worker's rank 0 mirrors on every TP rank (every rank process).

Applied by prefill_worker/ranks.py's ``PrefillRank``; see worker/tp_role.py for how they travel
(``[TAG, *fields]`` over msgpack). The decode worker's region arrives as a blob of descriptors,
one per decode rank (``kvtransfer.join_descriptors``); each rank uses its own.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import kvtransfer
from worker.tp_role import MirroredOp


class SendPoll(enum.IntEnum):
    """A request's transfer ops on one rank as a ``Poll`` reports them, ordered so that the min
    over the ranks is the replica's. Unlike decode's ``ReceivePoll``, in flight is the lowest: a
    failure here ends nothing until every rank's ops finished, since until then a write may
    still read the request's source blocks."""

    IN_FLIGHT = 0   # some op not finished (one may have failed already)
    FAILED = 1      # every op finished, at least one failed
    DONE = 2        # every op finished and succeeded


POLL_FIELDS = 1   # a Poll replies one SendPoll per request


@dataclass(frozen=True)
class Open(MirroredOp):
    """Start a request's transfer into ``dst_block_ids`` of the decode worker's region (this rank
    refuses block ids outside its region)."""

    TAG = "open"
    request_id: str
    descriptors: bytes
    dst_block_ids: list[int]


@dataclass(frozen=True)
class Write(MirroredOp):
    """Write ``layers`` of the source blocks into the destination blocks, pair by pair."""

    TAG = "write"
    request_id: str
    layers: list[int]
    src_block_ids: list[int]
    dst_block_ids: list[int]


@dataclass(frozen=True)
class Notify(MirroredOp):
    """The prompt is computed: tell the decode worker, with its first token."""

    TAG = "notify"
    request_id: str
    payload: kvtransfer.NotifyPayload

    def to_wire(self) -> list[Any]:
        p = self.payload
        return [self.TAG, self.request_id, [p.first_token_id, p.first_logprob, [list(t) for t in p.top_logprobs],
                                            p.num_prompt_tokens, p.num_cached_tokens]]

    @classmethod
    def from_wire(cls, wire: list[Any]) -> MirroredOp:
        if len(wire) != 3 or wire[0] != cls.TAG or not isinstance(wire[1], str):
            raise ValueError(f"malformed {cls.TAG!r} op")
        p = wire[2]
        if not (isinstance(p, list) and len(p) == 5 and type(p[0]) is int and isinstance(p[2], list)
                and (p[1] is None or isinstance(p[1], float)) and type(p[3]) is int and type(p[4]) is int):
            raise ValueError(f"malformed {cls.TAG!r} op payload")
        try:
            top = tuple((t, float(lp)) for t, lp in p[2] if type(t) is int and t >= 0)
        except (TypeError, ValueError, OverflowError) as exc:   # not pairs, float(10**400)
            raise ValueError(f"malformed {cls.TAG!r} op top logprobs: {exc}") from None
        if len(top) != len(p[2]):
            raise ValueError(f"malformed {cls.TAG!r} op top logprobs: token ids must be ints >= 0")
        return cls(wire[1], kvtransfer.NotifyPayload(p[0], p[1], top, p[3], p[4]))


@dataclass(frozen=True)
class Cancel(MirroredOp):
    TAG = "cancel"
    request_id: str
    reason: str


@dataclass(frozen=True)
class CancelAt(MirroredOp):
    """Cancel at the decode worker a request whose destination came before its Submit (no
    sender is open for it)."""

    TAG = "cancel_at"
    descriptors: bytes
    request_id: str
    reason: str


@dataclass(frozen=True)
class Forget(MirroredOp):
    """The request is over here: drop what the rank keeps of it."""

    TAG = "forget"
    request_id: str


@dataclass(frozen=True)
class Poll(MirroredOp):
    """Reply ``POLL_FIELDS`` ints per request: its ``SendPoll``."""

    TAG = "poll"
    request_ids: list[str]


OP_TYPES: tuple[type[MirroredOp], ...] = (Open, Write, Notify, Cancel, CancelAt, Forget, Poll)
