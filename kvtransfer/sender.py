"""The sending side of kvtransfer (runs in the prefill worker): one connection to one region.

``Sender`` is the interface every backend implements. ``ZmqSender`` is the real one: calls
validate arguments and queue an op; one stoppable worker thread owns the DEALER socket, runs
ops in order through a backend ``Writer`` (shm / tcp / cuda-ipc), answers the receiver's
cancels between ops, and heartbeats the requests it has open so their leases stay alive.
"""
from __future__ import annotations

import abc
import collections
import logging
import threading
import time
import uuid
from concurrent.futures import Future, wait
from typing import Any, Callable, Protocol, Sequence

import torch
import zmq

from .descriptor import RegionDescriptor
from .faults import FaultPlan
from .layout import KVLayout
from .messages import (
    MAX_BLOCK_IDS,
    MAX_HEARTBEAT_IDS,
    MAX_REQUEST_ID_LEN,
    Cancel,
    CancelAck,
    Heartbeat,
    MessageError,
    Notify,
    NotifyPayload,
    decode,
    encode,
)
from .server import CurveKeys

logger = logging.getLogger(__name__)

SNDHWM = 16  # messages queued before write() ops wait: back-pressure from a slow receiver
MAX_REMEMBERED_CANCELS = 1 << 16


class TransferCancelled(Exception):
    """The request was cancelled (by either side) before this op ran."""


class SenderClosed(Exception):
    """The sender was closed before this op ran."""


class Sender(abc.ABC):
    """Writes KV blocks of a local pool into one receiver's region."""

    def __init__(self, descriptor: RegionDescriptor, src_pool: torch.Tensor, layout: KVLayout,
                 backend: str) -> None:
        layout.check_compatible(descriptor.layout)  # raises LayoutMismatchError, writes nothing
        self.descriptor = descriptor
        self.layout = layout
        self.backend = backend
        self.src_pool = src_pool
        self.src_num_blocks = layout.check_pool(src_pool)
        self._cancel_lock = threading.Lock()
        self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()

    @abc.abstractmethod
    def open(self, request_id: str) -> Future[None]:
        """Keep ``request_id``'s lease alive from now on, before any write."""

    @abc.abstractmethod
    def write(self, request_id: str, layers: Sequence[int], src_block_ids: Sequence[int],
              dst_block_ids: Sequence[int]) -> Future[None]:
        """Copy ``src_block_ids[i]`` → ``dst_block_ids[i]`` for each of ``layers`` (K and V).

        Asynchronous; the future resolves once the bytes are handed off (one-sided backends:
        landed). Source blocks must stay unchanged until the receiver reports the request done.
        """

    @abc.abstractmethod
    def notify(self, request_id: str, payload: NotifyPayload) -> Future[None]:
        """Send the request's metadata; the receiver is done when this and every layer landed."""

    @abc.abstractmethod
    def cancel(self, request_id: str, reason: str = "cancelled by sender") -> Future[None]:
        """Stop writing this request and tell the receiver its blocks are free."""

    @abc.abstractmethod
    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every op queued so far has run."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the worker; queued ops that have not run fail with :class:`SenderClosed`."""

    def is_cancelled(self, request_id: str) -> bool:
        with self._cancel_lock:
            return request_id in self._cancelled

    def _mark_cancelled(self, request_id: str) -> None:
        with self._cancel_lock:
            self._cancelled[request_id] = None
            while len(self._cancelled) > MAX_REMEMBERED_CANCELS:
                self._cancelled.popitem(last=False)

    def _check_write(self, request_id: str, layers: Sequence[int], src_block_ids: Sequence[int],
                     dst_block_ids: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...],
                                                            tuple[int, ...]]:
        _check_request_id(request_id)
        layers_t = tuple(int(x) for x in layers)
        src = tuple(int(x) for x in src_block_ids)
        dst = tuple(int(x) for x in dst_block_ids)
        if not layers_t or len(set(layers_t)) != len(layers_t) or not all(
                0 <= x < self.layout.num_layers for x in layers_t):
            raise ValueError(f"layers must be unique ids in [0, {self.layout.num_layers}), got {layers_t}")
        if len(src) != len(dst) or len(dst) > MAX_BLOCK_IDS:
            raise ValueError(f"need as many src as dst block ids (<= {MAX_BLOCK_IDS}), got "
                             f"{len(src)} and {len(dst)}")
        if len(set(dst)) != len(dst):
            raise ValueError("dst_block_ids must be unique")
        if not all(0 <= b < self.src_num_blocks for b in src):
            raise ValueError(f"src_block_ids out of range [0, {self.src_num_blocks})")
        if not all(0 <= b < self.descriptor.num_blocks for b in dst):
            raise ValueError(f"dst_block_ids out of range [0, {self.descriptor.num_blocks})")
        return layers_t, src, dst


def _check_request_id(request_id: str) -> None:
    if type(request_id) is not str or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id must be a non-empty str of <= {MAX_REQUEST_ID_LEN} chars")


SendFn = Callable[..., Any]  # send(frames, copy=True, track=False) -> MessageTracker | None


class Writer(Protocol):
    """Backend data path: move the bytes and emit the message(s) that announce them."""

    def capture(self) -> object:
        """Runs in the caller's thread at write(): e.g. a CUDA event the copy must wait for."""

    def write(self, send: SendFn, ctx: object, request_id: str, layers: tuple[int, ...],
              src_block_ids: tuple[int, ...], dst_block_ids: tuple[int, ...]) -> None: ...

    def close(self) -> None: ...


class ZmqSender(Sender):
    def __init__(self, descriptor: RegionDescriptor, src_pool: torch.Tensor, layout: KVLayout,
                 backend: str, writer_factory: Callable[[Sender], Writer],
                 curve: CurveKeys | None = None, heartbeat_s: float = 1.0) -> None:
        super().__init__(descriptor, src_pool, layout, backend)
        self._writer = writer_factory(self)
        self._heartbeat_s = heartbeat_s
        self._faults = FaultPlan.from_env()   # None unless TANDEM_KV_FAULT_RATE is set
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, SNDHWM)
        if descriptor.curve_public_key is not None:
            keys = curve or CurveKeys.generate()
            self._sock.curve_serverkey = descriptor.curve_public_key
            self._sock.curve_publickey = keys.public
            self._sock.curve_secretkey = keys.secret
        self._sock.connect(descriptor.address)
        wake_addr = f"inproc://kvtransfer-sender-{uuid.uuid4().hex}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake_addr)
        self._lock = threading.Lock()       # guards _ops, _pending and the wake socket
        self._ops: collections.deque[tuple[Future, Callable[[], None]]] = collections.deque()
        self._pending: set[Future] = set()
        self._open: dict[str, None] = {}     # worker thread only: requests to heartbeat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtransfer-sender", daemon=True)
        self._thread.start()

    # -- caller side --------------------------------------------------------------------------
    def write(self, request_id, layers, src_block_ids, dst_block_ids) -> Future[None]:
        layers_t, src, dst = self._check_write(request_id, layers, src_block_ids, dst_block_ids)
        ctx = self._writer.capture()

        def op() -> None:
            self._open[request_id] = None
            if self._faults is not None:
                self._faults.check(request_id)
            self._writer.write(self._send, ctx, request_id, layers_t, src, dst)
        return self._submit(request_id, op)

    def open(self, request_id: str) -> Future[None]:
        """Start heartbeating ``request_id`` before its first write (it may queue for a while)."""
        def op() -> None:
            self._open[request_id] = None
        return self._submit(request_id, op)

    def notify(self, request_id: str, payload: NotifyPayload) -> Future[None]:
        data = encode(Notify(request_id, payload))  # validates bounds in the caller's thread

        def op() -> None:
            if self._faults is not None:
                self._faults.check_notify(request_id)
            self._open.pop(request_id, None)   # before the send: whoever hears it sees no more beats
            self._send([data])
        return self._submit(request_id, op)

    def cancel(self, request_id: str, reason: str = "cancelled by sender") -> Future[None]:
        data = encode(Cancel(request_id, reason))
        self._mark_cancelled(request_id)

        def op() -> None:
            self._open.pop(request_id, None)
            self._send([data])
        return self._submit(request_id, op, cancel_op=True)

    def closing(self) -> bool:
        """True once close() began: a writer waiting on its own transport gives up."""
        return self._stop.is_set()

    def flush(self, timeout_s: float | None = None) -> None:
        with self._lock:
            pending = list(self._pending)
        done, not_done = wait(pending, timeout=timeout_s)
        if not_done:
            raise TimeoutError(f"{len(not_done)} kvtransfer ops still queued after {timeout_s} s")

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout=10)
        with self._lock:
            dropped = list(self._ops)
            self._ops.clear()
            for s in (self._sock, self._wake_rx, self._wake_tx):
                s.close(linger=0)
        for fut, _ in dropped:  # outside the lock: done-callbacks take it
            if fut.set_running_or_notify_cancel():
                fut.set_exception(SenderClosed("sender closed"))
        self._writer.close()
        self._ctx.term()

    def _submit(self, request_id: str, fn: Callable[[], None], cancel_op: bool = False) -> Future[None]:
        _check_request_id(request_id)
        fut: Future[None] = Future()

        def op() -> None:
            if not cancel_op and self.is_cancelled(request_id):
                raise TransferCancelled(f"request_id={request_id} was cancelled")
            fn()
        with self._lock:
            if self._stop.is_set():
                raise SenderClosed("sender closed")
            self._ops.append((fut, op))
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        self._wake()
        return fut

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _wake(self) -> None:
        with self._lock:
            if not self._wake_tx.closed:
                self._wake_tx.send(b"", zmq.NOBLOCK)

    # -- worker thread ------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_beat = time.monotonic() + self._heartbeat_s
        while not self._stop.is_set():
            timeout_ms = max(0.0, next_beat - time.monotonic()) * 1000
            events = dict(poller.poll(int(timeout_ms)))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            try:
                self._recv_incoming()
                self._run_ops()
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + self._heartbeat_s
            except SenderClosed:
                return  # close() was called while a send waited for the receiver

    def _run_ops(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if not self._ops:
                    return
                fut, op = self._ops.popleft()
            self._recv_incoming()  # a cancel that arrived mid-request stops the next layer
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                op()
            except Exception as exc:  # surfaced to the caller through the future
                fut.set_exception(exc)
            else:
                fut.set_result(None)

    def _recv_incoming(self) -> None:
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(data)
            except MessageError as exc:
                logger.warning("ignored bad message from receiver: %s", exc)
                continue
            if isinstance(msg, Cancel):
                logger.info("receiver cancelled request_id=%s: %s", msg.request_id, msg.reason)
                self._mark_cancelled(msg.request_id)
                self._open.pop(msg.request_id, None)
                # Every write of ours for it has already run: promise that none follows.
                self._send([encode(CancelAck(msg.request_id))])

    def _heartbeat(self) -> None:
        ids = list(self._open)
        for i in range(0, len(ids), MAX_HEARTBEAT_IDS):
            self._send([encode(Heartbeat(tuple(ids[i:i + MAX_HEARTBEAT_IDS])))])

    def _send(self, frames: list, copy: bool = True, track: bool = False):
        # NOBLOCK + poll so a full queue (HWM back-pressure) or a gone receiver never wedges close().
        while True:
            try:
                return self._sock.send_multipart(frames, zmq.NOBLOCK, copy=copy, track=track)
            except zmq.Again:
                if self._stop.is_set():
                    raise SenderClosed("sender closed while waiting for the receiver") from None
                self._sock.poll(100, zmq.POLLOUT)
