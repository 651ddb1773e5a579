"""The tensor-parallel group of one replica: torch.distributed between its rank processes.

Runs in every rank process (rank 0 = the worker or `LLM` that schedules, ranks > 0 =
followers). Two process groups over one TCPStore hosted by rank 0: gloo for control messages
and CPU tensors, and NCCL for the model's all-reduces when the ranks run on CUDA (gloo again on
CPU). Process-group objects are built directly, not through torch's global default group, so
one process can hold several groups in turn (tests) and nothing module-level is mutated.

Control messages are ``(kind, msgpack body)``: an int64 header ``[kind, nbytes]`` broadcast
from rank 0, then the body as a uint8 tensor (typed msgpack only). Rank 0's :class:`Leader` wraps every
exchange in a lock-held transaction and pings idle followers, so a follower whose rank 0 is
gone (killed, or stuck) errors out of its receive within ``timeout_s``.

Rank 0 binds the store's listening socket itself, on ``dist_host`` only, and hands torch its
descriptor: a TCPStore given just a host and port listens on every interface.
"""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from engine.config import ParallelConfig

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0          # a collective waiting this long fails (a peer is gone)
HEARTBEAT_INTERVAL_S = 2.0        # rank 0 pings followers after this long without a message
MAX_TP_MESSAGE_BYTES = 64 << 20

# Message kinds (the first int64 of every header).
PING, STEP, OPS, STOP = 0, 1, 2, 3


class TPGroup:
    """This process's membership in its replica's TP group (rank ``rank`` of ``size``)."""

    def __init__(self, config: ParallelConfig, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.rank, self.size = config.tp_rank, config.tensor_parallel_size
        self.device = device
        timeout = timedelta(seconds=timeout_s)
        listener = _listen(config.dist_host, config.dist_port) if self.rank == 0 else None
        try:
            listen_fd = None if listener is None else listener.fileno()
            self.store: dist.TCPStore | None = dist.TCPStore(
                config.dist_host, config.dist_port, self.size, is_master=self.rank == 0, timeout=timeout,
                master_listen_fd=listen_fd)
        except BaseException:
            if listener is not None:
                listener.close()
            raise
        if listener is not None:
            listener.detach()   # the store owns the descriptor now and closes it when it goes
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=config.dist_host)]
        # Any: torch's stubs of these C++-bound groups lack allreduce/broadcast.
        self.cpu_group: Any = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", self.store), self.rank, self.size, opts)
        if device.type == "cuda":
            torch.cuda.set_device(device)   # NCCL binds this rank's communicator to its GPU
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            self.device_group: Any = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", self.store), self.rank,
                                                      self.size, nccl_opts)
        else:
            self.device_group = self.cpu_group
        logger.info("joined the tensor-parallel group as rank %d of %d (%s)", self.rank, self.size,
                    "gloo + nccl" if device.type == "cuda" else "gloo")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (the row-parallel layers' reduction)."""
        group = self.device_group if tensor.device.type == "cuda" else self.cpu_group
        group.allreduce([tensor]).wait()
        return tensor

    def all_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum of every rank's ``values`` (same length on every rank)."""
        if not values:
            return []
        tensor = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # RedOpType in the stubs
        self.cpu_group.allreduce([tensor], opts).wait()
        return tensor.tolist()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.cpu_group.broadcast([tensor], opts).wait()

    def send(self, kind: int, body: Any = None) -> None:
        """Rank 0: broadcast one message to every follower."""
        data = b"" if body is None else msgpack.packb(body, use_bin_type=True)
        if len(data) > MAX_TP_MESSAGE_BYTES:
            raise ValueError(f"a TP message of {len(data)} bytes exceeds {MAX_TP_MESSAGE_BYTES}")
        self._broadcast(torch.tensor([kind, len(data)], dtype=torch.int64))
        if data:
            self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def receive(self) -> tuple[int, Any]:
        """Follower: the next message from rank 0 (raises when rank 0 is gone or silent)."""
        header = torch.zeros(2, dtype=torch.int64)
        self._broadcast(header)
        kind, nbytes = header.tolist()
        if not 0 <= nbytes <= MAX_TP_MESSAGE_BYTES:
            raise ValueError(f"a TP message header announces {nbytes} bytes")
        if not nbytes:
            return kind, None
        data = torch.empty(nbytes, dtype=torch.uint8)
        self._broadcast(data)
        return kind, msgpack.unpackb(data.numpy().tobytes(), raw=False, strict_map_key=False)

    def close(self) -> None:
        for group in {id(self.cpu_group): self.cpu_group, id(self.device_group): self.device_group}.values():
            with contextlib.suppress(Exception):
                group.shutdown() if hasattr(group, "shutdown") else None
        self.store = None


class Leader:
    """Rank 0's side: every exchange with the followers runs inside ``transaction()``, which
    holds a lock so the heartbeat thread never interleaves a ping with a step's collectives.
    A failed exchange (a follower died) is kept in ``error`` and raised by ``check()``."""

    def __init__(self, group: TPGroup, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.group = group
        self.error: BaseException | None = None
        self._lock = threading.RLock()
        self._last_send_s = time.monotonic()
        self._interval_s = heartbeat_interval_s
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True)
        self._thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"a tensor-parallel follower is gone: {self.error}") from self.error

    @contextlib.contextmanager
    def transaction(self) -> Iterator[TPGroup]:
        with self._lock:
            self.check()
            try:
                yield self.group
            except BaseException as exc:
                # Followers may be waiting inside a collective this rank will never join: the
                # group is out of step for good (and gloo raises here when a peer died).
                if self.error is None:
                    self.error = exc
                raise
            finally:
                self._last_send_s = time.monotonic()

    def send(self, kind: int, body: Any = None) -> None:
        with self.transaction() as group:
            group.send(kind, body)

    def _heartbeat(self) -> None:
        while not self._stopping.wait(min(self._interval_s / 4, 0.5)):
            if time.monotonic() - self._last_send_s < self._interval_s:
                continue
            try:
                with self.transaction() as group:
                    if time.monotonic() - self._last_send_s >= self._interval_s:
                        group.send(PING)
            except Exception as exc:  # noqa: BLE001 - kept for check(), logged once
                if self.error is None:
                    self.error = exc
                logger.error("tensor-parallel heartbeat failed: %s", exc)
                return

    def stop(self) -> None:
        """Tell the followers to exit (best effort) and stop the heartbeat."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self.error is None:
            with contextlib.suppress(Exception):
                with self._lock:
                    self.group.send(STOP)


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` alone, for rank 0's TCPStore."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def free_local_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now (for a replica whose ranks this process spawns)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
