"""Worker registry of the router process: membership, heartbeats (Stats polls) and load.

A worker joins through ``add`` (the ``--prefill``/``--decode`` flags, or the RegisterWorker RPC
the controller calls). It is *joining* until its first Stats answer, then *healthy* and
routable. Liveness is not load: workers answer Stats from a snapshot, never by waiting on a
step, and a heartbeat that is merely late (DEADLINE_EXCEEDED) marks the worker *slow* in the
log, never dead. A worker is removed only when it is gone: its connection is refused or reset,
HTTP/2 keepalive pings go unanswered (a vanished host, a frozen process), or it reports its
engine thread dead (all UNAVAILABLE) -- on ``max_missed`` heartbeats in a row, or on one
probe after a request broke on it. Listeners (the dispatcher) hear about a removal and fail its
requests over. A joining worker is never removed, so the router may start before its workers.
``drain`` (scale-down) stops routing new requests to a worker while its in-flight ones finish; the
controller removes it once ``num_inflight`` is 0. Drain listeners (the dispatcher) hear about it
too: a decode worker's requests still waiting for their prompt's KV move to another one.

Every call to a worker carries the deployment's cluster secret (protos/auth.py). A worker that
refuses it, or whose Stats answer shows another model than the router's, is not routable: it
stays joining (or stops being healthy) and the log says why, once; ``check_new`` (the admin
service's RegisterWorker) removes it and says why to the caller.

"Another model" is decided on the model identity part of the worker's fingerprint
(engine/fingerprint.py: protocol version, architecture, hyper-parameters digest,
weights digest) -- the only part the router can know. It computes its own from its ``--model``
files when that is a built-in name or a local path; for a Hugging Face id (whose revision it
does not know, and which it must not download) the first worker to answer sets the identity the
others must match. Dtype, KV layout and TP size are the workers' business: a prefill and a
decode worker compare whole fingerprints at their SetDestination handshake. A worker that
reports no fingerprint (the in-process fakes of tests/router/fake_workers.py) is not checked.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from engine.fingerprint import Fingerprint, ModelIdentity, local_model_identity
from protos.auth import SecretStub
from protos.limits import MAX_MESSAGE_BYTES, ROLES
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc
from router.session import DecodeSession, PrefillSession

logger = logging.getLogger(__name__)
# HTTP/2 keepalive: a peer whose process froze or whose host vanished stops answering pings and
# the channel fails with UNAVAILABLE (the worker servers permit pings this often).
KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 10_000),
                     ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
GONE = frozenset({grpc.StatusCode.UNAVAILABLE})   # the only codes that say a worker is not there
REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


def cancel_requested() -> bool | None:
    """Whether the running task itself has been asked to cancel (``Task.cancelling``), as opposed
    to a CancelledError raised inside a call whose channel or stream something else closed; None
    on Python 3.10, which cannot tell (callers then decide from what they know closed the call)."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return None if cancelling is None else bool(cancelling())


@dataclass(eq=False)
class WorkerState:
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub | SecretStub
    session: DecodeSession | PrefillSession | None = None   # the stream every request goes on
    stats: worker_pb2.StatsResponse | None = None
    healthy: bool = False              # answered since it joined and has not been removed
    missed: int = 0                    # heartbeats in a row that found the worker gone
    late: int = 0                      # heartbeats in a row that timed out (slow, not dead)
    num_inflight: int = 0              # requests the router has on this worker now
    num_requests: int = 0              # requests the router sent it since it registered
    removed: bool = False
    draining: bool = False             # routable no more; kept until its in-flight requests end
    refused: str = ""                  # why it cannot be routed to (wrong secret, other model); logged once
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
                 max_missed: int = 2, *, secret: str | None = None, model: str = "",
                 dummy_weights: bool = False) -> None:
        """``secret``: sent on every call to a worker (None: none, for fake workers in tests);
        ``model``: the router's model -- a worker that serves another one is refused;
        ``dummy_weights``: the workers run random weights of ``model``'s shapes (--load-format dummy)."""
        self._secret = secret
        self.model = model
        self.dummy_weights = dummy_weights
        self._identity: ModelIdentity | None = None   # what every worker's fingerprint must show
        self._identity_from = ""                       # where it came from, for the log and errors
        self._identity_lock = asyncio.Lock()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_missed = max_missed
        self._workers: dict[str, WorkerState] = {}
        self._listeners: list[Callable[[WorkerState], None]] = []
        self._drain_listeners: list[Callable[[WorkerState], None]] = []
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()

    # -- membership -------------------------------------------------------------------------

    def on_removed(self, listener: Callable[[WorkerState], None]) -> None:
        self._listeners.append(listener)

    def on_drained(self, listener: Callable[[WorkerState], None]) -> None:
        self._drain_listeners.append(listener)

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
        channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                                              *KEEPALIVE_OPTIONS])
        stub_cls = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        stub = stub_cls(channel) if self._secret is None else SecretStub(stub_cls(channel), self._secret)
        session = (DecodeSession if role == "decode" else PrefillSession)(stub, address)
        worker = self._workers[address] = WorkerState(role, address, channel, stub, session)
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
        if worker.session is not None:
            await worker.session.close()
        await worker.channel.close()
        self._changed.set()
        return True

    def drain(self, addresses: list[str]) -> list[str]:
        """Stop routing new requests to these workers; their in-flight ones go on (scale-down).
        All are marked before any listener runs: a request a listener moves off one of them must
        not land on another (one at a time, a scale-down by 16 moved some requests 4 times and
        failed them). Returns the addresses known."""
        known = [self._workers[a] for a in dict.fromkeys(addresses) if a in self._workers]
        new = [w for w in known if not w.draining]
        for worker in new:
            worker.draining = True
            logger.info("draining %s worker %s (%d requests in flight)", worker.role, worker.address,
                        worker.num_inflight)
        for worker in new:
            for listener in self._drain_listeners:
                listener(worker)
        return [w.address for w in known]

    # -- load: the dispatcher's requests on each worker -------------------------------------

    @staticmethod
    def hold(worker: WorkerState) -> None:
        """A request the dispatcher sent now involves ``worker`` (``num_inflight``, ``num_requests``)."""
        worker.num_inflight += 1
        worker.num_requests += 1

    @staticmethod
    def release(worker: WorkerState) -> None:
        """``worker`` is done with a request it held (its part is over, or the request ended)."""
        worker.num_inflight -= 1

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
        lens = [w.stats.max_model_len for w in self._workers.values()
                if w.healthy and w.stats is not None and w.stats.max_model_len]
        return min(lens) if lens else None

    # -- heartbeats -------------------------------------------------------------------------

    async def poll(self, worker: WorkerState) -> bool:
        """One Stats call; True if it answered. Removes a healthy worker only when it is gone
        ``max_missed`` times in a row (see the module docstring); a late answer is never a death."""
        gone = await self._stats(worker)
        if gone and worker.healthy and worker.missed >= self.max_missed:
            await self.remove(worker.address, f"{worker.missed} heartbeats found it gone ({gone})")
        return gone is None and not worker.removed

    async def _stats(self, worker: WorkerState) -> str | None:
        """Refresh ``worker.stats``; None when it answered (or is only slow), else why it is gone."""
        try:
            stats = await worker.stub.Stats(worker_pb2.StatsRequest(), timeout=self.heartbeat_timeout_s)
        except asyncio.CancelledError:
            requested = cancel_requested()
            if requested or (requested is None and not worker.removed):
                raise
            # Not us: `remove` closed the channel under this call (another probe found it dead).
            # A CancelledError escaping here would end the caller's HTTP stream mid-response.
            worker.missed += 1
            return "channel closed"
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            if isinstance(exc, grpc.aio.AioRpcError):
                code, said = exc.code(), f"{exc.code().name}: {exc.details()}"
            else:
                code, said = grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED.name
            if code in GONE:
                worker.missed += 1
                return said
            if code in REFUSED:
                self._refuse(worker, f"it refused the router's cluster secret ({said})")
                return None
            worker.missed = 0
            worker.late += 1
            if worker.late == 1 and worker.healthy:
                logger.warning("%s worker %s is slow to answer Stats (%s); busy, not dead: it stays",
                               worker.role, worker.address, code.name)
            return None
        if worker.removed:
            return None
        worker.missed, worker.late = 0, 0
        mismatch = await self._model_mismatch(worker, stats)
        if worker.removed:
            return None
        if mismatch:
            self._refuse(worker, mismatch)
            return None
        worker.stats = stats
        if not worker.healthy:
            worker.healthy, worker.refused = True, ""
            logger.info("%s worker %s is healthy (model %s, max_model_len %d)", worker.role, worker.address,
                        stats.model, stats.max_model_len)
            self._changed.set()
        return None

    async def _model_mismatch(self, worker: WorkerState, stats: worker_pb2.StatsResponse) -> str:
        """Why ``worker`` serves another model than this router ("" if it does not); see the
        module docstring for what is compared."""
        if not stats.fingerprint:   # in-process fakes (tests/router/fake_workers.py) report none
            return ""
        try:
            theirs = Fingerprint.parse(stats.fingerprint).model
        except ValueError as exc:
            return f"its model fingerprint is unreadable: {exc}"
        async with self._identity_lock:
            if self._identity is None and not self._identity_from:
                self._identity = await asyncio.to_thread(self._own_identity)
            if self._identity is None:
                self._identity = theirs
                self._identity_from = f"{worker.role} worker {worker.address}, the first to answer"
                logger.info("workers must serve %s (set by %s)", theirs, self._identity_from)
        if theirs == self._identity:
            return ""
        return (f"it serves another model: its fingerprint is {stats.fingerprint} (--model {stats.model!r}) "
                f"but this router's model is {self._identity} ({self._identity_from})")

    def _own_identity(self) -> ModelIdentity | None:
        """The identity of the router's own ``--model`` files, or None when it cannot read them."""
        try:
            identity = local_model_identity(self.model, weights=not self.dummy_weights) if self.model else None
        except (OSError, ValueError) as exc:
            logger.warning("cannot read the model %r to check workers against (%s); the first worker "
                           "to answer sets the model", self.model, exc)
            identity = None
        self._identity_from = f"from --model {self.model!r}" if identity is not None else ""
        return identity

    def _refuse(self, worker: WorkerState, reason: str) -> None:
        """Keep ``worker`` out of routing (a healthy one stops taking requests); log it once."""
        if worker.refused != reason:
            logger.error("%s worker %s is not routable: %s", worker.role, worker.address, reason)
        worker.refused, worker.healthy = reason, False
        self._changed.set()

    async def check_new(self, address: str) -> str:
        """Ask a worker just added for its Stats once. If it answers and is refused (another model,
        or it refused the cluster secret) it is removed and the reason returned; "" when it is
        fine or does not answer yet (then it stays joining)."""
        worker = self._workers.get(address)
        if worker is None:
            return ""
        await self._stats(worker)
        reason = worker.refused
        if reason and not worker.removed:
            await self.remove(address, f"registration refused: {reason}")
        return reason

    async def probe(self, address: str) -> bool:
        """Check a worker a request found broken; remove it at once if it is gone (a slow
        answer keeps it). True while it stays registered."""
        worker = self._workers.get(address)
        if worker is None:
            return False
        gone = await self._stats(worker)
        if gone and worker.healthy and not worker.removed:
            await self.remove(address, f"gone after a failed request ({gone})")
            return False
        return not worker.removed

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
            if worker.session is not None:
                await worker.session.close()
            await worker.channel.close()
        self._workers.clear()

