"""One prefill rank's side of kvtransfer under tensor parallelism (every rank process).

Prefill rank r holds KV heads r of every computed prompt and writes them into decode rank r's
pool, through its own senders. Rank 0's PrefillLoop drives every rank with mirrored ops
(prefill_worker/ops.py, worker/tp_role.py) and the per-layer write plan it sends with each step:
the step's ``extra["writes"]``, ``[request_id, src_block_ids, dst_block_ids]`` to write after
every layer of that forward. An ``Open`` names the decode worker's region blob (one descriptor
per decode rank); this rank opens ``descriptors[rank]``.

Rank 0 applies an op before the followers do, so a bad destination (a TP size mismatch, a
layout mismatch, block ids outside the region) is refused there and mirrored nowhere; a
follower that still cannot open its region records a failed transfer instead of dying. Any
write or notify that fails -- refused by the sender, or failed while it ran -- fails its request
alone: the failure is recorded as that request's result, and the request is cancelled at its
sender, which stops renewing its lease and tells the decode worker to free the blocks.

Senders are cached per decode region and evicted (closed, their queued ops failed) when they
stall -- ops outstanding and none finished for ``stall_s``, as when the decode worker died and
its socket stopped draining -- or when no request has used them for ``stall_s``, so a dead
decode worker's pool is not kept mapped and no thread keeps heartbeating into the void.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

import kvtransfer
from prefill_worker.ops import OP_TYPES, Cancel, CancelAt, Forget, Notify, Open, Poll, SendPoll, Write
from worker.tp_role import MirroredOp, RoleHandler

logger = logging.getLogger(__name__)


class _SenderUse:
    """Ops outstanding on one cached sender and when it last made progress (any thread)."""

    __slots__ = ("outstanding", "progress_s")

    def __init__(self) -> None:
        self.outstanding = 0
        self.progress_s = time.monotonic()   # last op finished, first op queued, or last opened


class PrefillRank(RoleHandler):
    OP_TYPES = OP_TYPES

    def __init__(self, pool: torch.Tensor, tp_rank: int, tp_size: int, backend: str,
                 fabric: kvtransfer.FakeFabric | None = None, stall_s: float = 30.0,
                 secret: str | None = None) -> None:
        """``secret``: the cluster secret, so senders connect with CurveZMQ (None: plaintext, tests)."""
        self.pool = pool
        self.secret = secret
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.layout = kvtransfer.KVLayout.of_pool(pool, tp_rank=tp_rank)
        self.backend = backend
        self.fabric = fabric
        self.senders: dict[bytes, kvtransfer.Sender] = {}
        self.requests: dict[str, kvtransfer.Sender] = {}    # request_id -> its open sender
        self.futures: dict[str, list[Future]] = {}
        self.stall_s = stall_s
        self._use: dict[kvtransfer.Sender, _SenderUse] = {}   # per cached sender
        self._use_lock = threading.Lock()                  # done-callbacks run on sender threads

    # -- ops ---------------------------------------------------------------------------------
    def apply(self, ops: list[MirroredOp]) -> list[int]:
        reply: list[int] = []
        for op in ops:
            match op:
                case Open():
                    self._evict_stalled()
                    self._open(op.request_id, op.descriptors, op.dst_block_ids)
                case Write():
                    self.write(op.request_id, op.layers, op.src_block_ids, op.dst_block_ids)
                case Notify():
                    request_id, payload = op.request_id, op.payload
                    self._track(request_id, lambda s: s.notify(request_id, payload))
                case Cancel():
                    sender = self.requests.get(op.request_id)
                    if sender is not None:
                        try:
                            sender.cancel(op.request_id, op.reason)
                        except kvtransfer.SenderClosed:
                            pass   # evicted: nothing of this request can be written any more
                case CancelAt():
                    self._cancel_at(op.descriptors, op.request_id, op.reason)
                case Forget():
                    self.requests.pop(op.request_id, None)
                    self.futures.pop(op.request_id, None)
                case Poll():
                    self._evict_stalled()
                    for request_id in op.request_ids:
                        reply.append(int(self._poll(request_id)))
                case _:
                    raise ValueError(f"unknown prefill rank op {op!r}")
        return reply

    def _poll(self, request_id: str) -> SendPoll:
        futures = self.futures.get(request_id, [])
        if not all(f.done() for f in futures):
            return SendPoll.IN_FLIGHT
        return SendPoll.FAILED if any(f.exception() is not None for f in futures) else SendPoll.DONE

    def after_layer(self, extra: dict[str, Any]) -> Callable[[int], None] | None:
        writes = extra.get("writes")
        if not writes:
            return None
        def write_layer(layer: int) -> None:
            for rid, src, dst in writes:
                self.write(rid, [layer], src, dst)
        return write_layer

    def write(self, request_id: str, layers: list[int], src: list[int], dst: list[int]) -> None:
        self._track(request_id, lambda s: s.write(request_id, layers, src, dst))

    def error(self, request_id: str) -> BaseException | None:
        """This rank's first failure for the request, if any (for the log line)."""
        return next((f.exception() for f in self.futures.get(request_id, []) if f.done() and f.exception()), None)

    # -- senders -------------------------------------------------------------------------------
    def descriptor(self, descriptors: bytes) -> bytes:
        """This rank's region in a decode worker's blob; ValueError when the TP sizes differ."""
        per_rank = kvtransfer.split_descriptors(descriptors)
        if len(per_rank) != self.tp_size:
            raise ValueError(f"the decode worker has tensor_parallel_size={len(per_rank)} but this prefill worker "
                             f"has tensor_parallel_size={self.tp_size}; run prefill and decode workers with the "
                             "same --tensor-parallel-size")
        return per_rank[self.tp_rank]

    def sender(self, descriptors: bytes) -> kvtransfer.Sender:
        descriptor = self.descriptor(descriptors)
        sender = self.senders.get(descriptor)
        if sender is None:
            # A transfer that outlives the lease is lost anyway (nixl: a stopped decode worker's never ends).
            sender = kvtransfer.create_sender(descriptor, self.pool, self.layout, self.backend, fabric=self.fabric,
                                              secret=self.secret, transfer_timeout_s=self.stall_s)
            self.senders[descriptor] = sender
            self._use[sender] = _SenderUse()
        return sender

    def _evict_stalled(self) -> None:
        now = time.monotonic()
        for key, sender in list(self.senders.items()):
            use = self._use[sender]
            with self._use_lock:
                quiet_s, outstanding = now - use.progress_s, use.outstanding
            in_use = any(s is sender for s in self.requests.values())
            if quiet_s < self.stall_s or (in_use and not outstanding):
                continue
            logger.warning("evicting the kvtransfer sender to %s: %s for %.0f s", sender.descriptor.address,
                           f"{outstanding} ops stalled" if outstanding else "unused", quiet_s)
            del self.senders[key], self._use[sender]
            sender.close()   # fails its queued ops (SenderClosed): their requests fail, blocks return

    def _open(self, request_id: str, descriptors: bytes, dst_block_ids: list[int]) -> None:
        try:
            sender = self.sender(descriptors)
            num_blocks = sender.descriptor.num_blocks
            bad = [b for b in dst_block_ids if not 0 <= b < num_blocks]
            if bad:
                raise ValueError(f"request_id={request_id!r}: destination block ids {bad[:8]} are out of range "
                                 f"[0, {num_blocks}) of the decode worker's pool")
        except Exception as exc:
            if self.tp_rank == 0:
                raise           # refused before anything is mirrored: the caller reports it
            logger.error("TP rank %d cannot open request_id=%s: %s", self.tp_rank, request_id, exc)
            failed: Future = Future()
            failed.set_exception(exc)
            self.futures[request_id] = [failed]
            return
        self.requests[request_id] = sender
        self.futures[request_id] = []
        self._track(request_id, lambda s: s.open(request_id))

    def _cancel_at(self, descriptors: bytes, request_id: str, reason: str) -> None:
        try:
            self.sender(descriptors).cancel(request_id, reason)
        except Exception as exc:
            if self.tp_rank == 0:
                raise
            logger.warning("TP rank %d cannot cancel request_id=%s at its decode rank: %s", self.tp_rank,
                           request_id, exc)

    def _track(self, request_id: str, op: Callable[[kvtransfer.Sender], Future]) -> None:
        sender = self.requests.get(request_id)
        if sender is None:   # this rank could not open the region (already failed)
            return
        use = self._use.get(sender)   # None once evicted
        try:
            future = op(sender)
        except Exception as exc:  # refused before it was queued: fail this request, not the step
            logger.warning("kvtransfer op refused request_id=%s: %s", request_id, exc)
            future = Future()
            future.set_exception(exc)
        if use is not None:
            with self._use_lock:
                if not use.outstanding:
                    use.progress_s = time.monotonic()
                use.outstanding += 1
        future.add_done_callback(lambda f: self._on_done(sender, use, request_id, f))
        self.futures[request_id].append(future)

    def _on_done(self, sender: kvtransfer.Sender, use: _SenderUse | None, request_id: str, future: Future) -> None:
        """Count the sender's progress; a failed op ends its request at the sender: no more
        lease renewals for it, and the decode worker hears at once that the blocks will not be
        filled (runs on the sender's thread, or here for an op refused up front)."""
        if use is not None:
            with self._use_lock:
                use.outstanding -= 1
                use.progress_s = time.monotonic()
        exc = future.exception()
        if exc is None or sender.is_cancelled(request_id):
            return
        try:
            sender.cancel(request_id, f"KV write failed: {type(exc).__name__}: {exc}"[:512])
        except Exception as cancel_exc:  # noqa: BLE001 - the sender is closing; nothing is left to stop
            logger.debug("could not cancel request_id=%s: %s", request_id, cancel_exc)

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        self.senders.clear()
        self._use.clear()
