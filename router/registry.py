"""Worker registry of the router process: membership, heartbeats (Stats polls) and load.

A worker joins through ``add`` (the ``--prefill``/``--decode`` flags, or the RegisterWorker RPC
the controller calls). It is *joining* until its first Stats answer, then *healthy* and
routable. A healthy worker that misses ``max_missed`` heartbeats in a row, or that a request
reports as broken and then fails one immediate probe, is removed: listeners (the dispatcher)
hear about it and fail its requests over. A joining worker is never removed for silence, so
the router may start before its workers. ``drain`` (scale-down) stops routing new requests to a
worker while its in-flight ones finish; the controller removes it once ``num_inflight`` is 0.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
ROLES = ("prefill", "decode")
MAX_MESSAGE_BYTES = 64 << 20


@dataclass(eq=False)
class WorkerState:
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
    stats: worker_pb2.StatsResponse | None = None
    healthy: bool = False              # answered since it joined and has not been removed
    missed: int = 0                    # heartbeats missed in a row
    num_inflight: int = 0              # requests the router has on this worker now
    num_requests: int = 0              # requests the router sent it since it registered
    removed: bool = False
    draining: bool = False             # routable no more; kept until its in-flight requests end
    _probe: asyncio.Task | None = field(default=None, repr=False)

    @property
    def load(self) -> int:
        return self.num_inflight

    @property
    def kv_usage(self) -> float:
        if self.stats is None or not self.stats.kv_blocks_total:
            return 0.0
        return self.stats.kv_blocks_used / self.stats.kv_blocks_total


class WorkerRegistry:
    def __init__(self, heartbeat_interval_s: float = 1.0, heartbeat_timeout_s: float = 2.0,
                 max_missed: int = 2) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_missed = max_missed
        self._workers: dict[str, WorkerState] = {}
        self._listeners: list[Callable[[WorkerState], None]] = []
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()

    # -- membership -------------------------------------------------------------------------

    def on_removed(self, listener: Callable[[WorkerState], None]) -> None:
        self._listeners.append(listener)

    def add(self, role: str, address: str) -> WorkerState:
        """Register a worker (idempotent for the same role); it is routable after one Stats answer."""
        if role not in ROLES:
            raise ValueError(f"role={role!r}: use one of {ROLES}")
        if not address or ":" not in address:
            raise ValueError(f"address={address!r}: give host:port")
        known = self._workers.get(address)
        if known is not None:
            if known.role != role:
                raise ValueError(f"{address} is already registered as a {known.role} worker")
            return known
        channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        stub_cls = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        worker = self._workers[address] = WorkerState(role, address, channel, stub_cls(channel))
        logger.info("registered %s worker %s", role, address)
        if self._task is not None:
            worker._probe = asyncio.get_running_loop().create_task(self.poll(worker))
        return worker

    async def remove(self, address: str, reason: str = "deregistered") -> bool:
        worker = self._workers.pop(address, None)
        if worker is None:
            return False
        worker.removed, worker.healthy = True, False
        logger.warning("removed %s worker %s: %s", worker.role, address, reason)
        for listener in self._listeners:
            listener(worker)
        await worker.channel.close()
        self._changed.set()
        return True

    def drain(self, address: str) -> bool:
        """Stop routing new requests to a worker; its in-flight ones go on (scale-down)."""
        worker = self._workers.get(address)
        if worker is None:
            return False
        if not worker.draining:
            worker.draining = True
            logger.info("draining %s worker %s (%d requests in flight)", worker.role, address, worker.num_inflight)
        return True

    def get(self, address: str) -> WorkerState | None:
        return self._workers.get(address)

    def all(self) -> list[WorkerState]:
        return list(self._workers.values())

    def healthy(self, role: str) -> list[WorkerState]:
        """The routable workers of ``role``: answered heartbeats and not draining."""
        return [w for w in self._workers.values() if w.role == role and w.healthy and not w.draining]

    @property
    def max_model_len(self) -> int | None:
        """The smallest max_model_len any healthy worker reported (None before the first answer)."""
        lens = [w.stats.max_model_len for w in self._workers.values() if w.healthy and w.stats.max_model_len]
        return min(lens) if lens else None

    # -- heartbeats -------------------------------------------------------------------------

    async def poll(self, worker: WorkerState) -> bool:
        """One Stats call; True if it answered. Removes a healthy worker after too many misses."""
        try:
            stats = await worker.stub.Stats(worker_pb2.StatsRequest(), timeout=self.heartbeat_timeout_s)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            # Not us: `remove` closed the channel under this call (another probe found it dead).
            # A CancelledError escaping here would end the caller's HTTP stream mid-response.
            worker.missed += 1
            return False
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            worker.missed += 1
            if worker.healthy and worker.missed >= self.max_missed:
                detail = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "timeout"
                await self.remove(worker.address, f"{worker.missed} heartbeats missed ({detail})")
            return False
        if worker.removed:
            return False
        worker.stats, worker.missed = stats, 0
        if not worker.healthy:
            worker.healthy = True
            logger.info("%s worker %s is healthy (model %s, max_model_len %d)", worker.role, worker.address,
                        stats.model, stats.max_model_len)
            self._changed.set()
        return True

    async def probe(self, address: str) -> bool:
        """Check a worker a request found broken now; remove it at once if it does not answer."""
        worker = self._workers.get(address)
        if worker is None:
            return False
        if await self.poll(worker):
            return True
        if worker.healthy:
            await self.remove(address, "did not answer a probe after a failed request")
        return False

    async def wait_healthy(self, role: str, count: int = 1, timeout_s: float = 30.0) -> None:
        """Until ``count`` workers of ``role`` are healthy (tests and startup scripts)."""
        async def wait() -> None:
            while len(self.healthy(role)) < count:
                self._changed.clear()
                await self._changed.wait()
        await asyncio.wait_for(wait(), timeout_s)

    def start(self) -> None:
        self._stop.clear()
        self._task = asyncio.get_running_loop().create_task(self._heartbeat_loop(), name="router-heartbeats")

    async def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            workers = list(self._workers.values())
            if workers:
                await asyncio.gather(*(self.poll(w) for w in workers))
            try:
                await asyncio.wait_for(self._stop.wait(), self.heartbeat_interval_s)
            except asyncio.TimeoutError:
                pass

    async def stop(self) -> None:
        self._stop.set()
        tasks = [t for t in [self._task, *(w._probe for w in self._workers.values())] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        for worker in self._workers.values():
            await worker.channel.close()
        self._workers.clear()
