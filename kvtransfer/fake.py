"""fake backend: receiver and senders in one process, no sockets or threads (unit tests).

A ``FakeFabric`` instance stands in for the network: receivers register on it, senders find
them by region id. The fake sender behaves like a one-sided backend run synchronously: it
copies blocks into the receiver's pool, then hands the *encoded* ``WriteDone``/``Notify``/
``Cancel`` bytes to the same ``ReceiverCore.handle`` the ZeroMQ server uses, so message
validation and request state are the real code paths.
"""
from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future
from typing import Sequence

import torch

from .blockcopy import copy_blocks
from .descriptor import RegionDescriptor
from .layout import KVLayout, flat_bytes
from .messages import (
    Cancel,
    CancelAck,
    Heartbeat,
    Message,
    MessageError,
    Notify,
    NotifyPayload,
    WriteDone,
    decode,
    encode,
)
from .receiver import ReceiverCore
from .sender import Sender, SenderClosed, TransferCancelled


class FakeFabric:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cores: dict[str, ReceiverCore] = {}
        self._senders: dict[bytes, FakeSender] = {}

    def register(self, core: ReceiverCore) -> tuple[str, FakeTransport]:
        region_id = uuid.uuid4().hex
        with self._lock:
            self._cores[region_id] = core
        return region_id, FakeTransport(self, region_id)

    def core(self, region_id: str) -> ReceiverCore:
        with self._lock:
            if region_id not in self._cores:
                raise ValueError(f"no fake receiver with region_id={region_id}")
            return self._cores[region_id]

    def attach(self, peer: bytes, sender: FakeSender) -> None:
        with self._lock:
            self._senders[peer] = sender

    def detach(self, peer: bytes) -> None:
        with self._lock:
            self._senders.pop(peer, None)

    def unregister(self, region_id: str) -> None:
        with self._lock:
            self._cores.pop(region_id, None)

    def deliver(self, peer: bytes, data: bytes) -> None:
        with self._lock:
            sender = self._senders.get(peer)
        if sender is not None:
            sender._on_message(data)


class FakeTransport:
    def __init__(self, fabric: FakeFabric, region_id: str) -> None:
        self._fabric = fabric
        self._region_id = region_id

    def send(self, peer: bytes, msg: Message) -> None:
        self._fabric.deliver(peer, encode(msg))

    def close(self) -> None:
        self._fabric.unregister(self._region_id)


class FakeSender(Sender):
    def __init__(self, descriptor: RegionDescriptor, src_pool: torch.Tensor, layout: KVLayout,
                 fabric: FakeFabric) -> None:
        super().__init__(descriptor, src_pool, layout, "fake")
        if "fake" not in descriptor.transports:
            raise ValueError("receiver does not offer the fake transport")
        self._fabric = fabric
        self._core = fabric.core(descriptor.region_id)
        self._peer = uuid.uuid4().bytes
        self._src_flat = flat_bytes(src_pool)
        self._dst_flat = flat_bytes(self._core.pool)
        self._lock = threading.RLock()  # ops run in call order, like the real worker thread
        self._closed = False
        fabric.attach(self._peer, self)

    def write(self, request_id: str, layers: Sequence[int], src_block_ids: Sequence[int],
              dst_block_ids: Sequence[int]) -> Future[None]:
        layers_t, src, dst = self._check_write(request_id, layers, src_block_ids, dst_block_ids)

        def op() -> None:
            copy_blocks(self.layout, self._src_flat, self.src_num_blocks, self._dst_flat,
                        self.descriptor.num_blocks, layers_t, src, dst)
            self._deliver(WriteDone(request_id, layers_t, dst))
        return self._run(request_id, op)

    def open(self, request_id: str) -> Future[None]:
        return self._run(request_id, lambda: self._deliver(Heartbeat((request_id,))))

    def notify(self, request_id: str, payload: NotifyPayload) -> Future[None]:
        msg = Notify(request_id, payload)
        encode(msg)  # bounds are checked at the call, as in the real sender
        return self._run(request_id, lambda: self._deliver(msg))

    def cancel(self, request_id: str, reason: str = "cancelled by sender") -> Future[None]:
        self._mark_cancelled(request_id)
        return self._run(request_id, lambda: self._deliver(Cancel(request_id, reason)), True)

    def flush(self, timeout_s: float | None = None) -> None:
        return None

    def close(self) -> None:
        self._closed = True
        self._fabric.detach(self._peer)

    def _run(self, request_id: str, fn, cancel_op: bool = False) -> Future[None]:
        fut: Future[None] = Future()
        with self._lock:
            try:
                if self._closed:
                    raise SenderClosed("sender closed")
                if not cancel_op and self.is_cancelled(request_id):
                    raise TransferCancelled(f"request_id={request_id} was cancelled")
                fn()
            except Exception as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)
        return fut

    def _deliver(self, msg: Message) -> None:
        for peer, reply in self._core.handle(self._peer, [encode(msg)]):
            self._fabric.deliver(peer, encode(reply))

    def _on_message(self, data: bytes) -> None:
        try:
            msg = decode(data)
        except MessageError:
            return
        if isinstance(msg, Cancel):
            with self._lock:  # after any op in progress, like the worker thread
                self._mark_cancelled(msg.request_id)
                self._deliver(CancelAck(msg.request_id))
