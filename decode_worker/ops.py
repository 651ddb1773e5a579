"""The ops a decode worker's rank 0 mirrors on every TP rank's receiver (every rank process).

Applied by decode_worker/ranks.py's ``DecodeRank``; see worker/tp_role.py for how they travel
(``[TAG, *fields]`` over msgpack).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from worker.tp_role import MirroredOp


class ReceivePoll(enum.IntEnum):
    """A transfer's progress on one rank's receiver as a ``Poll`` reports it (SGLang's
    ``KVPoll``), ordered so that the min over the ranks is the replica's: one rank's failure
    fails the transfer at once, and it is done only once every rank has it."""

    FAILED = 0      # failed or cancelled
    IN_FLIGHT = 1   # expected, or being written
    DONE = 2        # every layer and the notify landed


# A Poll replies [ReceivePoll, freeable] per request. Freeable (the transfer ended and no writer
# can still touch its blocks) is a flag of its own: it is not a step of the progress above (a
# failed transfer may be freeable or not yet), so it has its own min ("every rank's is").
POLL_FIELDS = 2


@dataclass(frozen=True)
class Expect(MirroredOp):
    """Announce a reservation: the prompt's KV will be written into ``block_ids``."""

    TAG = "expect"
    request_id: str
    block_ids: list[int]
    num_layers: int
    lease_s: float


@dataclass(frozen=True)
class Cancel(MirroredOp):
    TAG = "cancel"
    request_id: str
    reason: str


@dataclass(frozen=True)
class Release(MirroredOp):
    """The transfer is over and its result read: the receiver forgets the request."""

    TAG = "release"
    request_id: str


@dataclass(frozen=True)
class Fence(MirroredOp):
    """The request moves to another prefill worker: its writers so far are refused from now on
    (kvtransfer ``Receiver.fence``)."""

    TAG = "fence"
    request_id: str
    reason: str


@dataclass(frozen=True)
class Poll(MirroredOp):
    """Reply ``POLL_FIELDS`` ints per request, so after the min-reduce rank 0 knows whether
    *every* rank has the transfer done, whether any failed, and whether every rank's blocks are
    freeable."""

    TAG = "poll"
    request_ids: list[str]


OP_TYPES: tuple[type[MirroredOp], ...] = (Expect, Cancel, Release, Fence, Poll)
