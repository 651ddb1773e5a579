"""One decode rank's side of kvtransfer under tensor parallelism (every rank process).

Each TP rank of a decode worker registers its own KV pool shard (its KV heads) with a
kvtransfer receiver; prefill rank r writes into decode rank r. Rank 0's DecodeLoop changes
receiver state on every rank through mirrored ops (decode_worker/ops.py, worker/tp_role.py):
``Expect`` a reservation, ``Cancel`` or ``Release`` it, ``Fence`` its writers when the request
moves to another prefill worker, and ``Poll`` transfers, whose reply (a ``ReceivePoll`` and a
freeable flag per request) is min-reduced so rank 0 knows whether *every* rank has the transfer
done, any failed it, and every rank's blocks are freeable.
"""
from __future__ import annotations

import kvtransfer
from decode_worker.ops import OP_TYPES, Cancel, Expect, Fence, Poll, ReceivePoll, Release
from worker.tp_role import MirroredOp, RoleHandler


class DecodeRank(RoleHandler):
    OP_TYPES = OP_TYPES

    def __init__(self, receiver: kvtransfer.Receiver) -> None:
        self.receiver = receiver

    def apply(self, ops: list[MirroredOp]) -> list[int]:
        reply: list[int] = []
        for op in ops:
            match op:
                case Expect():
                    self.receiver.expect(op.request_id, op.block_ids, op.num_layers, op.lease_s)
                case Cancel():
                    self.receiver.cancel(op.request_id, op.reason)
                case Release():
                    self.receiver.release(op.request_id)
                case Fence():
                    self.receiver.fence(op.request_id, op.reason)
                case Poll():
                    for request_id in op.request_ids:
                        reply += self._poll(request_id)
                case _:
                    raise ValueError(f"unknown decode rank op {op!r}")
        return reply

    def _poll(self, request_id: str) -> list[int]:
        result = self.receiver.result(request_id)
        status = result.status
        if status is kvtransfer.TransferStatus.DONE:
            poll = ReceivePoll.DONE
        elif status in (kvtransfer.TransferStatus.FAILED, kvtransfer.TransferStatus.CANCELLED):
            poll = ReceivePoll.FAILED
        else:
            poll = ReceivePoll.IN_FLIGHT
        return [int(poll), int(status.terminal and result.blocks_freeable)]

    def close(self) -> None:
        self.receiver.close()
