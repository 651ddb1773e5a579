"""nixl backend: one-sided writes over NIXL (UCX underneath) into a receiver's pool (both processes).

The receiver's NIXL agent registers its whole pool (host memory on CPU, GPU memory on CUDA) and
its metadata blob (``getLocalMD()``: the UCX worker address and the pool's remote keys) goes
into the ``RegionDescriptor``, which travels Tandem's authenticated control plane: NIXL's own
metadata listener and etcd are never used. A sender's agent registers its source pool, loads
that blob, and runs each ``write`` as one NIXL WRITE of (layer, K|V, run of consecutive blocks)
descriptors, waits for it under a deadline, then sends ``WriteDone`` on its CurveZMQ socket. NIXL's
UCX backend flushes the endpoint before it reports a transfer done, so the bytes are in the
receiver's memory before ``WriteDone`` leaves; notify, cancel, heartbeats and leases are the
ZeroMQ sender's and receiver's as for shm.

Security: NIXL and UCX neither authenticate nor encrypt. Whoever reaches a UCX worker's port and
holds a region's remote key can read and write that memory; the keys travel only the
authenticated control plane, but the bytes cross the network in clear. So UCX's sockets are
kept to one interface -- the one with the address the receiver binds, or the one that routes to
the receiver for a sender (``UCX_NET_DEVICES``, unless the environment sets it, as an RDMA
deployment naming its HCAs would) -- and the workers refuse nixl on a non-private address
unless told otherwise (``WorkerConfig.kv_nixl_allow_public``).

Pitfalls this module answers: NIXL's Python API gives its progress thread a poll delay of 0,
which spins a core for good, so agents are built through the bindings with
``PROGRESS_DELAY_US`` (the thread still wakes on UCX events at once; the delay only bounds a
periodic extra poll). A transfer to a stopped peer never completes, so every wait has a
deadline (``transfer_timeout_s``); a killed peer fails the transfer with
``nixlRemoteDisconnectError``. After either, the writer is broken and refuses every later write
at once, so a dead decode worker costs one deadline, not one per layer.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib
import ipaddress
import os
import socket
import struct
import threading
import time
import uuid
from types import ModuleType
from typing import Any, Callable, Iterator

import numpy as np
import torch

from .blockcopy import pair_runs
from .descriptor import NixlRegion
from .layout import KVLayout
from .messages import WriteDone, encode
from .sender import Sender, SendFn

EXTRA_HINT = ("the nixl kvtransfer backend needs NIXL: install it with `bash scripts/setup.sh --nixl` "
              "(or `pip install -e '.[nixl]'` once torch is installed)")
PROGRESS_DELAY_US = 100_000   # progress thread's periodic poll; UCX events wake it at once
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
_WAIT_FIRST_S, _WAIT_MAX_S = 20e-6, 2e-3   # completion polling backs off between these
_SIOCGIFADDR = 0x8915
_UCX_ENV_LOCK = threading.Lock()   # UCX reads UCX_NET_DEVICES from the environment at context creation


class NixlTransferError(RuntimeError):
    """A NIXL transfer failed, timed out, or its peer is gone; the writer stays broken after it."""


# UCX inside a Python process beside torch: no malloc/mmap hooks (NIXL registers each pool once;
# the tcp and shared-memory transports keep no registration cache) and no signal handlers of its
# own, so a crash stays Python's faulthandler's to report. A CI run's pytest process, with UCX
# loaded by the nixl tests, once died of SIGSEGV later in an unrelated test with no report at all;
# the cause was not found. An operator's own UCX settings win.
UCX_PROCESS_ENV = {"UCX_MEM_MALLOC_HOOKS": "no", "UCX_MEM_EVENTS": "no", "UCX_ERROR_SIGNALS": ""}


def bindings() -> ModuleType:
    """NIXL's C++ bindings: the meta package's, else the wheel for this torch's CUDA, else any."""
    for key, value in UCX_PROCESS_ENV.items():
        os.environ.setdefault(key, value)     # read by UCX when it loads, below
    cuda = (torch.version.cuda or "").split(".")[0]
    names = ["nixl", *(f"nixl_cu{m}" for m in dict.fromkeys((cuda, "12", "13")) if m)]
    for name in names:
        try:
            return importlib.import_module(f"{name}._bindings")
        except ImportError:
            continue
    raise ImportError(EXTRA_HINT)


def interface_of(address: str) -> str:
    """The network interface that has ``address`` (IPv4 or IPv6), for ``UCX_NET_DEVICES``."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) == 6 and ipaddress.IPv6Address(int(fields[0], 16)) == ip:
                    return fields[5]
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    req = struct.pack("256s", name.encode()[:15])
                    got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
                except OSError:
                    continue   # an interface without an IPv4 address
                if socket.inet_ntoa(got[20:24]) == str(ip):
                    return name
    raise ValueError(f"no network interface has the address {address}: the nixl backend binds UCX to the "
                     "interface of the worker's --host (a wildcard address has none); bind a specific "
                     "address, or set UCX_NET_DEVICES yourself")


def route_source(address: str) -> str:
    """The local address this host uses to reach ``address`` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return str(s.getsockname()[0])


def zmq_host(endpoint: str) -> str:
    """``tcp://1.2.3.4:5`` or ``tcp://[::1]:5`` -> the host part."""
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


@contextlib.contextmanager
def _ucx_devices(address: str) -> Iterator[str]:
    """UCX_NET_DEVICES set to ``address``'s interface while an agent's UCX context is made (an
    operator's own UCX_NET_DEVICES wins)."""
    with _UCX_ENV_LOCK:
        own = os.environ.get("UCX_NET_DEVICES")
        if own:
            yield own
            return
        os.environ["UCX_NET_DEVICES"] = devices = interface_of(address)
        try:
            yield devices
        finally:
            os.environ.pop("UCX_NET_DEVICES", None)


class NixlAgent:
    """One NIXL agent on the UCX backend: a registered pool, remote agents, WRITE transfers.

    ``address``: an address of this host whose interface UCX may use (nothing else is opened).
    """

    def __init__(self, address: str, role: str) -> None:
        nb = bindings()
        self._nb = nb
        config = nb.nixlAgentConfig()
        config.useProgThread = True
        config.pthrDelay = PROGRESS_DELAY_US
        config.useListenThread = False   # metadata travels Tandem's control plane, never a NIXL port
        config.syncMode = nb.NIXL_THREAD_SYNC_STRICT
        config.captureTelemetry = False
        self.name = f"tandem-{role}-{uuid.uuid4().hex}"
        with _ucx_devices(address) as devices:
            self._agent = nb.nixlAgent(self.name, config)
            self._backend = self._agent.createBackend("UCX", {})
        self.net_devices = devices
        self._registered: list[Any] = []
        self._remotes: list[str] = []

    def register(self, pool: torch.Tensor) -> NixlRegion:
        """Register ``pool``'s bytes; returns what a remote agent needs to write them."""
        nbytes = pool.numel() * pool.element_size()
        on_cuda = pool.device.type == "cuda"
        device_id = (pool.device.index or 0) if on_cuda else 0
        seg = self._nb.VRAM_SEG if on_cuda else self._nb.DRAM_SEG
        descs = self._nb.nixlRegDList(seg, [(pool.data_ptr(), nbytes, device_id, "")])
        self._agent.registerMem(descs, [self._backend])
        self._registered.append(descs)
        return NixlRegion(bytes(self._agent.getLocalMD()), pool.data_ptr(), device_id,
                          "VRAM" if on_cuda else "DRAM")

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.loadRemoteMD(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.append(name)
        return name

    def write(self, remote: str, mem_types: tuple[str, str], local: np.ndarray, remote_descs: np.ndarray,
              deadline_s: float, stop: Callable[[], bool]) -> None:
        """WRITE ``local[i]`` (rows of address, nbytes, device) to ``remote_descs[i]``; returns
        once the bytes are in the remote memory. Raises :class:`NixlTransferError` on an error,
        a gone peer or at ``deadline_s`` (monotonic)."""
        nb = self._nb
        seg = {"DRAM": nb.DRAM_SEG, "VRAM": nb.VRAM_SEG}
        src = nb.nixlXferDList(seg[mem_types[0]], local)
        dst = nb.nixlXferDList(seg[mem_types[1]], remote_descs)
        handle = None
        try:
            handle = self._agent.createXferReq(nb.NIXL_WRITE, src, dst, remote, b"", [self._backend])
            status = self._agent.postXferReq(handle, b"")
            wait_s = _WAIT_FIRST_S
            while status == nb.NIXL_IN_PROG:
                if time.monotonic() >= deadline_s:
                    raise NixlTransferError(f"NIXL write to {remote} not done by its deadline: the peer is "
                                            "stopped or the link is down")
                if stop():
                    raise NixlTransferError("sender closed while a NIXL write was in flight")
                time.sleep(wait_s)
                wait_s = min(2 * wait_s, _WAIT_MAX_S)
                status = self._agent.getXferStatus(handle)
            if status != nb.NIXL_SUCCESS:
                raise NixlTransferError(f"NIXL write to {remote} failed: {status}")
        except NixlTransferError:
            raise
        except Exception as exc:   # nixlRemoteDisconnectError (a killed peer) and NIXL's other errors
            raise NixlTransferError(f"NIXL write to {remote} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if handle is not None:
                with contextlib.suppress(Exception):   # an unfinished one is cancelled, or stays till close
                    self._agent.releaseXferReq(handle)

    def close(self) -> None:
        """Forget remote agents (disconnects), deregister memory; the agent stops with its last reference."""
        for name in self._remotes:
            with contextlib.suppress(Exception):
                self._agent.invalidateRemoteMD(name)
        for descs in self._registered:
            with contextlib.suppress(Exception):
                self._agent.deregisterMem(descs, [self._backend])
        self._remotes, self._registered = [], []
        self._agent = self._backend = None


class NixlWriter:
    """Sender side: NIXL WRITEs from the source pool into the receiver's, then ``WriteDone``."""

    def __init__(self, sender: Sender, transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S) -> None:
        d = sender.descriptor
        if "nixl" not in d.transports or d.nixl is None:
            raise ValueError("receiver does not offer the nixl transport")
        if not transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {transfer_timeout_s}")
        self._sender = sender
        self._layout: KVLayout = sender.layout
        self._timeout_s = transfer_timeout_s
        self._src_num_blocks = sender.src_num_blocks
        self._dst_num_blocks = d.num_blocks
        self._dst = d.nixl
        self._agent: NixlAgent | None = NixlAgent(route_source(zmq_host(d.address)), "send")
        try:
            src = self._agent.register(sender.src_pool)
            self._remote = self._agent.add_remote(d.nixl.agent_metadata)
        except BaseException:
            self._agent.close()
            raise
        self._src = src
        self._mem_types = (src.mem_type, d.nixl.mem_type)
        self._broken: str | None = None

    def capture(self) -> object:
        if self._sender.src_pool.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()  # the caller's stream: this layer's KV is ready once it fires
        return event

    def write(self, send: SendFn, ctx: object, request_id: str, layers: tuple[int, ...],
              src_block_ids: tuple[int, ...], dst_block_ids: tuple[int, ...]) -> None:
        if self._broken is not None:
            raise NixlTransferError(f"the NIXL path to this receiver is broken: {self._broken}")
        assert self._agent is not None, "write after close"
        if isinstance(ctx, torch.cuda.Event):
            ctx.synchronize()   # CUDA source: the layer's compute has written the blocks
        local, remote = self._descs(layers, src_block_ids, dst_block_ids)
        stop = getattr(self._sender, "closing", lambda: False)
        try:
            self._agent.write(self._remote, self._mem_types, local, remote,
                              time.monotonic() + self._timeout_s, stop)
        except NixlTransferError as exc:
            self._broken = str(exc)
            raise
        send([encode(WriteDone(request_id, layers, dst_block_ids))])

    def _descs(self, layers: tuple[int, ...], src_block_ids: tuple[int, ...],
               dst_block_ids: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Rows of (address, nbytes, device): one per (layer, K|V, run of consecutive pairs)."""
        runs = np.asarray(pair_runs(src_block_ids, dst_block_ids), dtype=np.int64).reshape(-1, 3)
        bn = self._layout.block_nbytes
        # (layer, kv) planes in layout order: the byte offset of block b of plane p is
        # (p * num_blocks + b) * block_nbytes (KVLayout.offset).
        planes = np.asarray([layer * 2 + kv for layer in layers for kv in (0, 1)], dtype=np.int64)
        n = len(planes) * len(runs)

        def rows(base: int, num_blocks: int, first: np.ndarray, device_id: int) -> np.ndarray:
            out = np.empty((n, 3), dtype=np.uint64)
            out[:, 0] = (base + ((planes[:, None] * num_blocks + first[None, :]) * bn)).reshape(-1)
            out[:, 1] = np.tile(runs[:, 2] * bn, len(planes))
            out[:, 2] = device_id
            return out

        return (rows(self._src.base_addr, self._src_num_blocks, runs[:, 0], self._src.device_id),
                rows(self._dst.base_addr, self._dst_num_blocks, runs[:, 1], self._dst.device_id))

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None


class AgentTransport:
    """A receiver's ZeroMQ transport that also owns its NIXL agent (closed after the socket)."""

    def __init__(self, transport: Any, agent: NixlAgent) -> None:
        self._transport = transport
        self.agent = agent

    def send(self, peer: bytes, msg: Any) -> None:
        self._transport.send(peer, msg)

    def close(self) -> None:
        self._transport.close()
        self.agent.close()


def register_pool(pool: torch.Tensor, host: str) -> tuple[NixlAgent, NixlRegion]:
    """Receiver side: an agent on ``host``'s interface with ``pool`` registered."""
    agent = NixlAgent(host, "recv")
    try:
        return agent, agent.register(pool)
    except BaseException:
        agent.close()
        raise

