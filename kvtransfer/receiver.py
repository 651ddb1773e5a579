"""The receiving side of kvtransfer (runs in the decode worker): a registered KV pool.

``ReceiverCore`` turns incoming frames into validated messages and state changes; it owns the
pool and is transport-agnostic, so the fake backend and the fuzz tests drive it directly.
``Receiver`` is the public object: the core plus a transport (a ZeroMQ server thread, or a
fake fabric endpoint). Nothing from a socket is trusted: every frame is checked against the
request's expected blocks and the layout before a byte is copied, and rejects are counted.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from .blockcopy import runs
from .descriptor import ONE_SIDED, RegionDescriptor
from .layout import KVLayout, flat_bytes
from .messages import (
    Cancel,
    CancelAck,
    Heartbeat,
    Message,
    MessageError,
    Notify,
    WriteDone,
    WritePayload,
    decode,
    max_frame_nbytes,
)
from .tracker import RequestTable, TransferResult, TransferStatus

logger = logging.getLogger(__name__)

Reply = tuple[bytes, Message]  # (peer id, message to send it)


class ReceiverCore:
    def __init__(self, pool: torch.Tensor, layout: KVLayout, transports: Sequence[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.layout = layout
        self.num_blocks = layout.check_pool(pool)
        self.transports = tuple(transports)
        self.pool = pool
        self._flat = flat_bytes(pool)
        self._flat_np = self._flat.numpy() if pool.device.type == "cpu" else None
        self.cond = threading.Condition()
        self.table = RequestTable(self.num_blocks, layout.num_layers,
                                  one_sided=bool(ONE_SIDED & set(self.transports)), clock=clock)
        self.counters: collections.Counter[str] = collections.Counter()
        self._runs_cache: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}

    def handle(self, peer: bytes, frames: Sequence) -> list[Reply]:
        """Apply one multipart message from ``peer``; never raises on bad input."""
        msg: Message | None = None
        try:
            msg = self._decode(frames)
            with self.cond:
                replies = self._apply(peer, msg, frames)
                self.counters["accepted"] += 1
                self.cond.notify_all()
            return replies
        except MessageError as exc:
            self.counters["rejected"] += 1
            self.counters[f"rejected_{exc.reason}"] += 1
            logger.debug("rejected message from peer=%s: %s", peer.hex(), exc)
            # Tell a sender still writing for a dead request to stop (it answers with an ack).
            if (exc.reason in ("unknown_request", "inactive_request", "fenced_writer")
                    and isinstance(msg, (WritePayload, WriteDone, Notify))):
                return [(peer, Cancel(msg.request_id, exc.reason))]
            return []

    def _decode(self, frames: Sequence) -> Message:
        if not frames:
            raise MessageError("frame_count", "empty message")
        msg = decode(_buffer(frames[0]))
        if isinstance(msg, WritePayload):
            if "tcp" not in self.transports:
                raise MessageError("transport_not_offered", "tcp")
            if len(frames) != 1 + 2 * len(msg.layers):
                raise MessageError("frame_count", f"{len(frames) - 1} payload frames for "
                                   f"{len(msg.layers)} layers")
            nbytes = len(msg.dst_block_ids) * self.layout.block_nbytes
            if nbytes > max_frame_nbytes(self.layout.block_nbytes):
                raise MessageError("frame_size", f"{len(msg.dst_block_ids)} blocks in one frame")
            if any(len(f) != nbytes for f in frames[1:]):
                raise MessageError("frame_size", f"expected {nbytes} bytes per frame")
        elif len(frames) != 1:
            raise MessageError("frame_count", "control message with extra frames")
        elif isinstance(msg, WriteDone) and not ONE_SIDED & set(self.transports):
            raise MessageError("transport_not_offered", "one-sided write")
        return msg

    def _apply(self, peer: bytes, msg: Message, frames: Sequence) -> list[Reply]:
        table = self.table
        if isinstance(msg, (WritePayload, WriteDone)):
            req = table.check_write(peer, msg.request_id, msg.layers, msg.dst_block_ids)
            if isinstance(msg, WritePayload):
                self._scatter(msg, frames[1:])
                self.counters["payload_bytes"] += (len(frames) - 1) * len(msg.dst_block_ids) * self.layout.block_nbytes
            table.mark_landed(peer, req, msg.layers, msg.dst_block_ids)
        elif isinstance(msg, Notify):
            table.notify(peer, msg.request_id, msg.payload)
        elif isinstance(msg, Cancel):
            table.cancelled_by_sender(peer, msg.request_id, msg.reason)
        elif isinstance(msg, CancelAck):
            table.acked(peer, msg.request_id)
        elif isinstance(msg, Heartbeat):
            return [(peer, Cancel(r, "not active")) for r in table.heartbeat(peer, msg.request_ids)]
        return []

    def _scatter(self, msg: WritePayload, payload_frames: Sequence) -> None:
        # Frame i*2+kv holds the blocks of layer msg.layers[i] in dst order; copy each run of
        # consecutive dst ids as one slice.
        bn = self.layout.block_nbytes
        dst_runs = self._runs_cache.get(msg.dst_block_ids)
        if dst_runs is None:
            dst_runs = runs(msg.dst_block_ids)
            self._runs_cache = {msg.dst_block_ids: dst_runs}  # a request's layers share ids
        for i, layer in enumerate(msg.layers):
            for kv in (0, 1):
                src = np.frombuffer(_buffer(payload_frames[2 * i + kv]), dtype=np.uint8)
                for first, start, count in dst_runs:
                    off = self.layout.offset(layer, kv, first, self.num_blocks)
                    chunk = src[start * bn:(start + count) * bn]
                    if self._flat_np is not None:
                        self._flat_np[off:off + count * bn] = chunk
                    else:
                        self._flat[off:off + count * bn].copy_(torch.from_numpy(chunk.copy()))

    def expire(self) -> None:
        with self.cond:
            if self.table.expire():
                self.cond.notify_all()


class Transport(Protocol):
    def send(self, peer: bytes, msg: Message) -> None: ...
    def close(self) -> None: ...


class Receiver:
    """A registered KV pool that senders write into. Create with ``create_receiver``."""

    def __init__(self, core: ReceiverCore, descriptor: RegionDescriptor,
                 transport: Transport, default_lease_s: float = 30.0) -> None:
        self._core = core
        self.descriptor = descriptor
        self._transport = transport
        self._default_lease_s = default_lease_s

    @property
    def layout(self) -> KVLayout:
        return self._core.layout

    def expect(self, request_id: str, dst_block_ids: Sequence[int], num_layers: int | None = None,
               lease_s: float | None = None) -> None:
        """Announce a request before handing its dst blocks to a sender."""
        with self._core.cond:
            self._core.table.expect(request_id, dst_block_ids,
                                    self.layout.num_layers if num_layers is None else num_layers,
                                    self._default_lease_s if lease_s is None else lease_s)

    def status(self, request_id: str) -> TransferStatus:
        return self.result(request_id).status

    def result(self, request_id: str) -> TransferResult:
        self._core.expire()
        with self._core.cond:
            return self._core.table.result(request_id)

    def wait(self, request_id: str, timeout_s: float | None = None,
             freeable: bool = False) -> TransferResult:
        """Block until the request is terminal (and, with ``freeable``, its blocks reusable)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        core = self._core
        while True:
            res = self.result(request_id)
            if res.status.terminal and (res.blocks_freeable or not freeable):
                return res
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return res
            with core.cond:
                # Short slices let lazy lease expiry run even when no message arrives.
                core.cond.wait(0.05 if remaining is None else min(remaining, 0.05))

    def cancel(self, request_id: str, reason: str = "cancelled by receiver") -> None:
        with self._core.cond:
            peers = self._core.table.cancel(request_id, reason)
            self._core.cond.notify_all()
        logger.info("cancel request_id=%s reason=%s peers=%d", request_id, reason, len(peers))
        for peer in peers:
            self._transport.send(peer, Cancel(request_id, reason))

    def fence(self, request_id: str, reason: str = "moved to another writer") -> None:
        """Hand an unfinished request to a new writer (failover): the writers so far are told to
        stop and refused from now on; the new one must write every layer and notify again."""
        with self._core.cond:
            peers = self._core.table.fence(request_id)
            self._core.cond.notify_all()
        logger.info("fence request_id=%s reason=%s peers=%d", request_id, reason, len(peers))
        for peer in peers:
            self._transport.send(peer, Cancel(request_id, reason))

    def finished(self) -> list[str]:
        """Requests that are terminal with freeable blocks, not yet released."""
        self._core.expire()
        with self._core.cond:
            return self._core.table.finished()

    def release(self, request_id: str) -> tuple[int, ...]:
        """Forget a finished request and return its dst block ids for the allocator."""
        with self._core.cond:
            return self._core.table.release(request_id)

    def stats(self) -> dict[str, int]:
        """Messages accepted and rejected (by reason), and payload bytes scattered into the pool."""
        with self._core.cond:
            return dict(self._core.counters)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _buffer(frame: object) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return buf if buf is not None else memoryview(frame)  # type: ignore[arg-type]
