"""One decode rank's side of kvtransfer under tensor parallelism (every rank process).

Each TP rank of a decode worker registers its own KV pool shard (its KV heads) with a
kvtransfer receiver; prefill rank r writes into decode rank r. Rank 0's DecodeLoop changes
receiver state on every rank through mirrored ops (engine/tp_role.py):

- ``["expect", request_id, block_ids, num_layers, lease_s]``: announce a reservation;
- ``["cancel", request_id, reason]`` / ``["release", request_id]``;
- ``["fence", request_id, reason]``: the request moves to another prefill worker; the writers
  so far are refused from now on (kvtransfer ``Receiver.fence``);
- ``["poll", [request_id, ...]]``: reply ``[done, freeable, not_failed]`` per request, so after
  the min-reduce rank 0 knows whether *every* rank has the transfer done (or freeable).
"""
from __future__ import annotations

from typing import Any

import kvtransfer
from engine.tp_role import RoleHandler

POLL_FIELDS = 3   # done, freeable, not_failed


class DecodeRank(RoleHandler):
    def __init__(self, receiver: kvtransfer.Receiver) -> None:
        self.receiver = receiver

    def apply(self, ops: list[Any]) -> list[int]:
        reply: list[int] = []
        for op in ops:
            name = op[0]
            if name == "expect":
                self.receiver.expect(op[1], op[2], op[3], op[4])
            elif name == "cancel":
                self.receiver.cancel(op[1], op[2])
            elif name == "release":
                self.receiver.release(op[1])
            elif name == "fence":
                self.receiver.fence(op[1], op[2])
            elif name == "poll":
                for request_id in op[1]:
                    reply += self._poll(request_id)
            else:
                raise ValueError(f"unknown decode rank op {name!r}")
        return reply

    def _poll(self, request_id: str) -> list[int]:
        result = self.receiver.result(request_id)
        failed = result.status in (kvtransfer.TransferStatus.FAILED, kvtransfer.TransferStatus.CANCELLED)
        return [int(result.status is kvtransfer.TransferStatus.DONE),
                int(result.status.terminal and result.blocks_freeable), int(not failed)]

    def close(self) -> None:
        self.receiver.close()
