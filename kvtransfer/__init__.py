"""kvtransfer: one-sided KV block transfers between worker processes (docs/architecture.md#kv-transfer).

A decode worker registers its KV pool with :func:`create_receiver` and hands out
``receiver.descriptor.to_bytes()``; a prefill worker opens it with :func:`create_sender` and
calls ``write`` (per layer, asynchronous) and ``notify``. Backends: ``shm`` (same host, /dev/shm
pool), ``tcp`` (ZeroMQ frames), ``cuda-ipc`` (same host GPUs), ``nixl`` (NIXL/UCX one-sided
writes, any host; an optional extra, unauthenticated data plane: kvtransfer/nixl.py), ``fake``
(in-process) and ``auto`` (never nixl). Given the cluster secret (``secret=``, as the workers
do), every ZeroMQ connection is CurveZMQ-encrypted and authenticated with keys derived from it.
This package imports only numpy, torch, zmq and msgpack, and NIXL's bindings in kvtransfer/nixl.py
when that backend is asked for.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

from .descriptor import (
    TRANSPORTS,
    CudaIpcHandle,
    RegionDescriptor,
    join_descriptors,
    local_host_id,
    split_descriptors,
)
from .fake import FakeFabric, FakeSender
from .layout import KVLayout, LayoutMismatchError
from .messages import MessageError, NotifyPayload
from .receiver import Receiver, ReceiverCore, Transport
from .region import check_pool_path, create_shm_pool, is_pool_path, map_shm_pool, remove_shm_pool
from .sender import Sender, SenderClosed, TransferCancelled, Writer, ZmqSender
from .server import CurveKeys, ZmqServer
from .tracker import TransferResult, TransferStatus

BACKENDS = ("auto", *TRANSPORTS)   # auto: shm or cuda-ipc on the same host, else tcp (never nixl)

__all__ = [
    "BACKENDS", "CurveKeys", "CudaIpcHandle", "FakeFabric", "KVLayout", "LayoutMismatchError",
    "MessageError", "NotifyPayload", "Receiver", "RegionDescriptor", "Sender", "SenderClosed",
    "TransferCancelled", "TransferResult", "TransferStatus", "check_pool_path", "create_receiver",
    "create_sender", "create_shm_pool", "join_descriptors", "map_shm_pool", "remove_shm_pool",
    "select_backend", "split_descriptors",
]


def create_receiver(pool: torch.Tensor, layout: KVLayout, backend: str = "auto", *,
                    shm_path: str | None = None, host: str = "127.0.0.1",
                    lease_s: float = 30.0, secret: str | None = None, curve: CurveKeys | None = None,
                    allowed_clients: list[bytes] | None = None,
                    fabric: FakeFabric | None = None) -> Receiver:
    """Register ``pool`` (shape ``layout.pool_shape(num_blocks)``) for incoming writes.

    ``host`` is the address the ZeroMQ socket binds (a port is picked at random) and, for nixl,
    the address whose interface UCX may use; ``lease_s`` is the default lease of expected
    requests. ``secret`` (the cluster secret; the workers always give it) turns on CurveZMQ with
    the deployment's keys and admits only senders that hold them; ``curve`` /
    ``allowed_clients`` (Z85 public keys) set keys and allow-list by hand.
    """
    if secret is not None and curve is None:
        curve = CurveKeys.from_secret(secret)
        allowed_clients = [curve.public] if allowed_clients is None else allowed_clients
    transports = _receiver_transports(pool, backend, shm_path)
    if backend == "fake":
        if fabric is None:
            raise ValueError("backend='fake' needs a FakeFabric (fabric=...)")
        core = ReceiverCore(pool, layout, transports)
        transport: Transport
        region_id, transport = fabric.register(core)
        address = f"fake://{region_id}"
    else:
        core = ReceiverCore(pool, layout, transports)
        server = ZmqServer(core, host, curve, allowed_clients)
        transport, address, region_id = server, server.address, os.urandom(8).hex()
    nixl = None
    if "nixl" in transports:
        from .nixl import AgentTransport, register_pool
        try:
            agent, nixl = register_pool(pool, host)
        except BaseException:
            transport.close()
            raise
        transport = AgentTransport(transport, agent)
    cuda = None
    if "cuda-ipc" in transports:
        from .cuda_ipc import export_cuda_pool
        cuda = export_cuda_pool(pool)
    descriptor = RegionDescriptor(
        layout, core.num_blocks, transports, address, local_host_id(), region_id,
        shm_path if "shm" in transports else None, cuda,
        curve.public if curve is not None and backend != "fake" else None, nixl)
    return Receiver(core, descriptor, transport, default_lease_s=lease_s)


def _receiver_transports(pool: torch.Tensor, backend: str, shm_path: str | None) -> tuple[str, ...]:
    on_cuda = pool.device.type == "cuda"
    if backend == "auto":
        if on_cuda:
            return ("cuda-ipc", "tcp")
        return ("shm", "tcp") if shm_path else ("tcp",)
    if backend == "shm" and (on_cuda or not shm_path):
        raise ValueError("backend='shm' needs a CPU pool mapped from /dev/shm and its shm_path")
    if backend == "cuda-ipc" and not on_cuda:
        raise ValueError("backend='cuda-ipc' needs a CUDA pool")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {BACKENDS}")
    return (backend,)


def select_backend(descriptor: RegionDescriptor, src_pool: torch.Tensor) -> str:
    """``auto``: shm / cuda-ipc when the receiver is on this host, tcp otherwise."""
    offered = descriptor.transports
    same_host = descriptor.host_id == local_host_id()
    if same_host and "cuda-ipc" in offered and src_pool.device.type == "cuda":
        return "cuda-ipc"
    if same_host and "shm" in offered and src_pool.device.type == "cpu" and is_pool_path(descriptor.shm_path):
        return "shm"
    if "tcp" in offered:
        return "tcp"
    raise ValueError(f"no usable transport among {offered} from this host")


def create_sender(descriptor: RegionDescriptor | bytes, src_pool: torch.Tensor,
                  layout: KVLayout, backend: str = "auto", *, secret: str | None = None,
                  curve: CurveKeys | None = None, heartbeat_s: float = 1.0,
                  transfer_timeout_s: float = 30.0, fabric: FakeFabric | None = None) -> Sender:
    """Open a receiver's region for writes from ``src_pool``.

    Raises :class:`LayoutMismatchError` when ``layout`` differs from the receiver's, and
    ValueError when ``secret`` is given and the receiver does not serve with this deployment's
    CurveZMQ key (plaintext, or another deployment's). ``heartbeat_s`` must be well under the
    receiver's lease. ``transfer_timeout_s`` (nixl): the deadline of one write's transfer, after
    which that write fails and the sender refuses every later one (a stopped or gone receiver).
    """
    if isinstance(descriptor, (bytes, bytearray)):
        descriptor = RegionDescriptor.from_bytes(bytes(descriptor))
    if secret is not None and curve is None and backend != "fake":
        curve = CurveKeys.from_secret(secret)
        if descriptor.curve_public_key != curve.public:
            raise ValueError(f"the receiver at {descriptor.address} does not use this deployment's CurveZMQ key "
                             f"({'none' if descriptor.curve_public_key is None else 'another'}): it is not "
                             "of this deployment, or runs without the cluster secret")
    if backend == "auto":
        backend = select_backend(descriptor, src_pool)
    if backend == "fake":
        if fabric is None:
            raise ValueError("backend='fake' needs the receiver's FakeFabric (fabric=...)")
        return FakeSender(descriptor, src_pool, layout, fabric)
    writer: Callable[[Sender], Writer]
    if backend == "shm":
        from .shm import ShmWriter as writer
    elif backend == "tcp":
        from .tcp import TcpWriter as writer
    elif backend == "cuda-ipc":
        from .cuda_ipc import CudaIpcWriter as writer
    elif backend == "nixl":
        from .nixl import NixlWriter
        writer = functools.partial(NixlWriter, transfer_timeout_s=transfer_timeout_s)
    else:
        raise ValueError(f"backend={backend!r}: use one of {BACKENDS}")
    return ZmqSender(descriptor, src_pool, layout, backend, writer, curve, heartbeat_s)
