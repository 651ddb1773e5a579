"""What a worker role adds to tensor parallelism: ops rank 0 mirrors on every rank.

Runs in every rank process of a TP replica. A role's per-rank state (a decode rank's kvtransfer
receiver, a prefill rank's senders) lives in a :class:`RoleHandler` (the hooks a follower rank
runs, engine/tp/follower.py's ``FollowerHooks``, with ops); rank 0 changes it only
through :class:`MirroredOps`, which applies a list of ops to its own handler and broadcasts the
same list to the followers' handlers, so every rank does its own side of each transfer. Each op
is a :class:`MirroredOp` dataclass (the roles declare theirs in ``prefill_worker/ops.py`` and
``decode_worker/ops.py``) and handlers dispatch on its type. On the wire (msgpack, see
engine/tp/group.py) an op is the list ``[TAG, *fields]``, decoded on a follower only into
the op types its handler declares, each field type-checked; a reply is a list of ints,
min-reduced over the ranks (e.g. "every rank has this transfer done").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from engine.tp.follower import FollowerHooks
from engine.tp.group import OPS, Leader


def _is_int(value: Any) -> bool:
    return type(value) is int   # bool is an int subclass, and never a block id or count


# Field annotation (as written in the op's class) -> what a decoded value must be.
WIRE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "bytes": lambda v: isinstance(v, bytes),
    "int": _is_int,
    "float": lambda v: isinstance(v, float) or _is_int(v),
    "list[int]": lambda v: isinstance(v, list) and all(type(x) is int for x in v),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}


@dataclass(frozen=True)
class MirroredOp:
    """One change to a role's per-rank state. Subclasses are frozen dataclasses with a unique
    ``TAG``; fields annotated with a type of ``WIRE_CHECKS`` need no wire code of their own."""

    TAG: ClassVar[str] = ""

    def to_wire(self) -> list[Any]:
        return [self.TAG, *(getattr(self, f.name) for f in fields(self))]

    @classmethod
    def from_wire(cls, wire: list[Any]) -> MirroredOp:
        """The op ``wire`` (from ``to_wire``, through msgpack) encodes; ValueError if malformed."""
        wire_fields = fields(cls)
        if len(wire) != 1 + len(wire_fields) or wire[0] != cls.TAG:
            raise ValueError(f"a {cls.TAG!r} op has {len(wire_fields)} fields, got {wire[:1]} with {len(wire) - 1}")
        for f, value in zip(wire_fields, wire[1:]):
            if not WIRE_CHECKS[str(f.type)](value):
                raise ValueError(f"op {cls.TAG!r}: field {f.name} is not a {f.type}: {type(value).__name__}")
        return cls(*wire[1:])


class RoleHandler(FollowerHooks):
    """One rank's role state, changed by the ops of its ``OP_TYPES``."""

    OP_TYPES: ClassVar[tuple[type[MirroredOp], ...]] = ()   # the ops ``apply`` takes

    def apply_wire(self, wire: Any) -> list[int]:
        return self.apply(self.decode(wire))

    def apply(self, ops: list[MirroredOp]) -> list[int]:
        """Apply rank 0's ops in order; return this rank's reply (may be empty)."""
        if ops:
            raise ValueError(f"this rank has no role to apply {len(ops)} ops")
        return []

    @classmethod
    def decode(cls, wire: Any) -> list[MirroredOp]:
        """Rank 0's ops from their wire form, as this role's op types (ValueError otherwise)."""
        by_tag = {t.TAG: t for t in cls.OP_TYPES}
        if not isinstance(wire, list):
            raise ValueError(f"mirrored ops arrive as a list, not {type(wire).__name__}")
        ops = []
        for item in wire:
            if not isinstance(item, list) or not item or not isinstance(item[0], str) or item[0] not in by_tag:
                raise ValueError(f"unknown {cls.__name__} op {item[:1] if isinstance(item, list) else item!r}")
            ops.append(by_tag[item[0]].from_wire(item))
        return ops


class MirroredOps:
    """Rank 0's (or a TP=1 worker's) way to change role state on every rank."""

    def __init__(self, handler: RoleHandler, leader: Leader | None) -> None:
        self.handler = handler
        self.leader = leader

    def run(self, ops: list[MirroredOp], reply: bool = False) -> list[int]:
        """Apply ``ops`` here first (a ValueError here mirrors nothing), then on every follower;
        with ``reply``, return the element-wise minimum of every rank's reply."""
        local = self.handler.apply(ops)
        if self.leader is None:
            return local
        with self.leader.transaction() as group:
            group.send(OPS, {"ops": [op.to_wire() for op in ops], "reply": reply})
            return group.all_min(local) if reply else local
