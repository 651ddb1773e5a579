"""What a worker role adds to tensor parallelism: ops rank 0 mirrors on every rank.

Runs in every rank process of a TP replica. A role's per-rank state (a decode rank's kvtransfer
receiver, a prefill rank's senders) lives in a :class:`RoleHandler`; rank 0 changes it only
through :class:`MirroredOps`, which applies a list of ops to its own handler and broadcasts the
same list to the followers' handlers, so every rank does its own side of each transfer. Ops are
plain msgpack-able lists ``[name, *args]``; a reply is a list of ints, min-reduced over the ranks
(e.g. "every rank has this transfer done").
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.distributed import OPS, Leader


class RoleHandler:
    """One rank's role state. The base class is the `LLM` follower's: forward only."""

    def after_layer(self, extra: dict[str, Any]) -> Callable[[int], None] | None:
        """The hook for one step's forward, from the ``extra`` rank 0 sent with the step."""
        return None

    def apply(self, ops: list[Any]) -> list[int]:
        """Apply rank 0's ops in order; return this rank's reply (may be empty)."""
        if ops:
            raise ValueError(f"this rank has no role to apply {len(ops)} ops")
        return []

    def close(self) -> None:
        """Called once the rank stops."""


class MirroredOps:
    """Rank 0's (or a TP=1 worker's) way to change role state on every rank."""

    def __init__(self, handler: RoleHandler, leader: Leader | None) -> None:
        self.handler = handler
        self.leader = leader

    def run(self, ops: list[Any], reply: bool = False) -> list[int]:
        """Apply ``ops`` here first (a ValueError here mirrors nothing), then on every follower;
        with ``reply``, return the element-wise minimum of every rank's reply."""
        local = self.handler.apply(ops)
        if self.leader is None:
            return local
        with self.leader.transaction() as group:
            group.send(OPS, {"ops": ops, "reply": reply})
            return group.all_min(local) if reply else local
