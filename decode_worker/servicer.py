"""gRPC servicer of the decode worker: the Session stream, SetPrefill, Abort and Stats (asyncio thread).

Also the decode side's client of the prefill workers: it tells a prefill worker where to
write (SetDestination) and aborts there when a stream is cancelled. SetDestination is the model
handshake both ways (engine/fingerprint.py): it carries this worker's fingerprint, the
prefill worker refuses a different one (FAILED_PRECONDITION), and a prefill worker whose answer
carries a different (or no) fingerprint is refused here; either way the request fails with both
fingerprints in its error.

Requests arrive only on Session streams (the router's one per worker; worker.proto). Stream events
cross from the engine thread once per step: the engine loop hands its whole batch to ``deliver``
(one ``call_soon_threadsafe``), ``_fan_out`` puts each event on its session, and each session
sends every request's waiting events in one DecodeSessionResponse, one GenerateResponse per
request -- one step's token while the router keeps up, several steps' tokens when it lags behind.
"""
from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc

from decode_worker.worker import DecodeJob, DecodeLoop, EventBatch, StreamEvent
from engine.config import SamplingParams
from engine.fingerprint import check_peer
from protos.auth import SecretStub
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc
from worker.convert import check_request, logprobs_to_proto, sampling_from_proto
from worker.session import SessionState

logger = logging.getLogger(__name__)


MAX_PREFILL_CHANNELS = 64        # prefill workers this worker keeps a channel open to (LRU)
MAX_ADDRESS_LEN = 255
# host:port, host a DNS name, an IPv4 address or a bracketed IPv6 one: nothing gRPC would read as
# a scheme (unix:, unix-abstract:, vsock:, dns:///...) or as several addresses.
_ADDRESS = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})")


def prefill_address_error(address: str) -> str | None:
    """Why a caller-supplied prefill worker address is refused, or None: a holder of the cluster
    secret must not make this worker dial a unix socket or anything but a TCP host:port."""
    match = _ADDRESS.fullmatch(address) if len(address) <= MAX_ADDRESS_LEN else None
    if match is None or not 0 < int(match.group(1)) < 65536:
        return f"prefill_address {address[:80]!r} is not a host:port"
    return None


class PrefillClients:
    """One aio channel per prefill worker address, used from the asyncio thread; every call
    carries the cluster secret (``secret=None``: none, for in-process tests). At most
    ``max_channels`` stay open: the least recently used is closed (its calls in flight get a
    grace period) when another address is dialled, so callers cannot grow the cache without bound."""

    def __init__(self, secret: str | None = None, max_channels: int = MAX_PREFILL_CHANNELS) -> None:
        self._secret = secret
        self._max_channels = max_channels
        # A stub, or one whose every method sends the secret: the same methods either way.
        self._open: OrderedDict[str, tuple[grpc.aio.Channel, Any]] = OrderedDict()
        self._closing: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._open)

    def stub(self, address: str) -> Any:
        error = prefill_address_error(address)
        if error is not None:
            raise ValueError(error)
        entry = self._open.get(address)
        if entry is not None:
            self._open.move_to_end(address)
            return entry[1]
        channel = grpc.aio.insecure_channel(address)
        stub: Any = worker_pb2_grpc.PrefillWorkerStub(channel)
        stub = stub if self._secret is None else SecretStub(stub, self._secret)
        self._open[address] = (channel, stub)
        while len(self._open) > self._max_channels:
            _, (old, _) = self._open.popitem(last=False)
            task = asyncio.get_running_loop().create_task(old.close(grace=5.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return stub

    async def close(self) -> None:
        for channel, _ in self._open.values():
            await channel.close()
        self._open.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _fan_out(batch: EventBatch) -> None:
    for sink, event in batch:
        sink(event)


def _response(events: list[StreamEvent], params: SamplingParams
              ) -> tuple[worker_pb2.GenerateResponse | None, bool, StreamEvent | None]:
    """One message for a request's events since its last one: (the message, or None when it
    would be empty; whether the request is over; the error event it failed with, if it did). An
    error or a finish is a request's last event."""
    response = worker_pb2.GenerateResponse()
    k = params.logprobs or 0
    for event in events:
        if event.error is not None:
            return (response if response.token_ids else None), True, event
        response.token_ids.extend(event.token_ids)
        if params.logprobs is not None:
            response.logprobs.extend(logprobs_to_proto(t, e, k) for t, e in zip(event.token_ids, event.logprobs))
        if event.finish_reason is not None:
            response.finish_reason = event.finish_reason
            response.num_prompt_tokens = event.num_prompt_tokens
            response.num_output_tokens = event.num_output_tokens
            response.num_cached_tokens = event.num_cached_tokens
            return response, True, None
    return (response if response.token_ids else None), False, None


class _Session(SessionState):
    """One Session stream's state: its open requests, and per request the events (or the refusal)
    not yet sent, filled by ``_fan_out`` and the reader."""

    def __init__(self) -> None:
        super().__init__()
        self.jobs: dict[str, DecodeJob] = {}
        self.pending: dict[str, tuple[list[StreamEvent], tuple[grpc.StatusCode, str] | None]] = {}

    def sink(self, request_id: str) -> Callable[[StreamEvent], None]:
        def put(event: StreamEvent) -> None:
            entry = self.pending.get(request_id)
            if entry is None:
                self.pending[request_id] = ([event], None)
                self.wake()
            else:
                entry[0].append(event)
        return put

    def refuse(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self.pending[request_id] = ([], (code, message))
        self.wake()

    async def take(self) -> dict[str, tuple[list[StreamEvent], tuple[grpc.StatusCode, str] | None]]:
        """Everything pending; waits for something while the reader reads (or, once the router
        has closed its side, while requests are open)."""
        while not self.pending and (self.reading or self.jobs):
            await self.wait()
        pending, self.pending = self.pending, {}
        return pending


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, prefill: PrefillClients, rpc_timeout_s: float = 30.0, fingerprint: str = "") -> None:
        """``fingerprint``: this worker's (engine.fingerprint); every prefill worker refuses
        an empty one, so only in-process tests that never send SetDestination leave it out."""
        self.prefill = prefill
        self.fingerprint = fingerprint
        self.rpc_timeout_s = rpc_timeout_s
        self.aio_loop: asyncio.AbstractEventLoop | None = None  # set by the first Session

    def attach(self, loop: DecodeLoop) -> None:
        """Wire the engine thread (built after this servicer, since it calls send_destination)."""
        self.loop = loop
        self.vocab_size = loop.engine.arch.vocab_size
        self.max_model_len = loop.engine.max_model_len

    def deliver(self, batch: EventBatch) -> None:
        """``DecodeLoop``'s ``deliver``: called on the engine thread once per step with every stream's events."""
        assert self.aio_loop is not None   # set by the Session that brought these requests
        try:
            self.aio_loop.call_soon_threadsafe(_fan_out, batch)
        except RuntimeError:
            pass  # the server is shutting down; nobody reads these streams any more

    # Called on the engine thread when blocks are reserved.
    def send_destination(self, job: DecodeJob, descriptor: bytes) -> None:
        assert self.aio_loop is not None   # set by the Session that brought the request
        asyncio.run_coroutine_threadsafe(self._send_destination(job, descriptor), self.aio_loop)

    async def _send_destination(self, job: DecodeJob, descriptor: bytes) -> None:
        request = worker_pb2.SetDestinationRequest(request_id=job.request_id, block_ids=job.transfer_block_ids,
                                                   region_descriptor=descriptor, fingerprint=self.fingerprint)
        try:
            response = await self.prefill.stub(job.prefill_address).SetDestination(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                # The prefill worker may be gone: keep the reservation, so the router can move the
                # request to another prefill worker (SetPrefill); the lease is the backstop.
                logger.warning("prefill worker %s unreachable for request_id=%s (%s); keeping the reservation",
                               job.prefill_address, job.request_id, exc.code().name)
                return
            reason = f"prefill worker {job.prefill_address} refused the destination: {exc.code().name}: {exc.details()}"
            self.loop.call(lambda: self.loop.fail(job.request_id, reason))
            return
        refused = check_peer(self.fingerprint, response.fingerprint, "decode", "prefill")
        if refused:
            reason = f"refused prefill worker {job.prefill_address}: {refused}"
            self.loop.call(lambda: self.loop.fail(job.request_id, reason))
            await self._abort_prefill(job.prefill_address, job.request_id)

    async def _abort_prefill(self, address: str, request_id: str) -> None:
        try:
            await self.prefill.stub(address).Abort(worker_pb2.AbortRequest(request_id=request_id),
                                                   timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError:
            pass  # already done there, or the worker is gone: nothing left to stop

    def _job(self, request: worker_pb2.GenerateRequest, sink: Callable[[StreamEvent], None]) -> DecodeJob:
        """The job for ``request``; ValueError (INVALID_ARGUMENT) when it is malformed."""
        prompt = list(request.prompt_token_ids)
        check_request(request.request_id, prompt, self.vocab_size, self.max_model_len)
        params = sampling_from_proto(request.sampling)
        if request.local_prefill == bool(request.prefill_address):
            raise ValueError("name the prefill worker computing this prompt (prefill_address) or ask for "
                             "local_prefill, not both" if request.local_prefill else
                             "prefill_address is empty: name the prefill worker computing this prompt "
                             "or ask for local_prefill")
        if request.prefill_address and (error := prefill_address_error(request.prefill_address)) is not None:
            raise ValueError(error)
        return DecodeJob(request.request_id, prompt, params, request.prefill_address, sink=sink)

    def _stopped(self, job: DecodeJob, aio_loop: asyncio.AbstractEventLoop) -> None:
        """Free everything a request holds here and at its prefill worker (its reader went away)."""
        request_id = job.request_id
        self.loop.call(lambda: self.loop.abort(request_id))
        if job.prefill_address:
            aio_loop.create_task(self._abort_prefill(job.prefill_address, request_id))

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        """Many requests on one stream (the router's data plane): see worker.proto's DecodeSessionRequest.
        A request that is refused or fails ends with an output carrying its error_code; when the
        stream breaks, every request still open on it is stopped and freed here and at its prefill worker."""
        aio_loop = self.aio_loop = asyncio.get_running_loop()
        session = _Session()

        def admit(jobs: list[DecodeJob]) -> None:   # engine thread
            for job in jobs:
                try:
                    self.loop.add(job)
                except (KeyError, ValueError) as exc:
                    code = (grpc.StatusCode.ALREADY_EXISTS if isinstance(exc, KeyError)
                            else grpc.StatusCode.INVALID_ARGUMENT)
                    aio_loop.call_soon_threadsafe(session.refuse, job.request_id, code, str(exc.args[0]))

        def admit_compiled(job: DecodeJob) -> None:
            if job.request_id in session.jobs:      # not aborted meanwhile
                self.loop.call(lambda: admit([job]))

        def handle(message: worker_pb2.DecodeSessionRequest) -> None:
            jobs = []
            for request in message.generate:
                rid = request.request_id
                if rid in session.jobs:   # the router never does this: the first one goes on
                    logger.warning("session: request_id=%s is already open on it; ignored", rid)
                    continue
                try:
                    job = self._job(request, session.sink(rid))
                except ValueError as exc:
                    session.refuse(rid, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    continue
                if not self.loop.alive:
                    session.refuse(rid, grpc.StatusCode.UNAVAILABLE, "the engine thread is not running")
                    continue
                session.jobs[rid] = job
                if job.params.structured is None:
                    jobs.append(job)
                else:
                    session.compile_then(self.loop.engine.compile_grammar, job.params.structured,
                                         partial(admit_compiled, job),
                                         partial(session.refuse, rid, grpc.StatusCode.INVALID_ARGUMENT))
            if jobs:
                self.loop.call(lambda: admit(jobs))
            for rid in message.abort:
                aborted = session.jobs.pop(rid, None)
                if aborted is not None:
                    self._stopped(aborted, aio_loop)

        session.read(request_iterator, handle)
        try:
            while session.reading or session.jobs or session.pending:
                response = worker_pb2.DecodeSessionResponse()
                for rid, (events, refusal) in (await session.take()).items():
                    job = session.jobs.get(rid)
                    if refusal is not None:
                        session.jobs.pop(rid, None)
                        response.outputs.append(worker_pb2.GenerateResponse(
                            request_id=rid, error_code=refusal[0].value[0], error=refusal[1]))
                        continue
                    if job is None:
                        continue   # aborted by the router: it reads nothing more of it
                    out, finished, error = _response(events, job.params)
                    if finished:
                        del session.jobs[rid]
                    if error is not None:
                        assert error.error is not None   # _response returns the event that failed
                        out = out or worker_pb2.GenerateResponse()
                        out.error_code, out.error = grpc.StatusCode.UNAVAILABLE.value[0], error.error
                        out.error_transient = error.transient
                    if out is not None:
                        out.request_id = rid
                        response.outputs.append(out)
                if response.outputs:
                    yield response
                session.check()   # the stream broke: stop what it left open (finally)
        finally:
            session.close()
            for job in session.jobs.values():   # the router went away: free what it left open
                self._stopped(job, aio_loop)
            session.jobs.clear()

    async def SetPrefill(self, request: worker_pb2.SetPrefillRequest, context: grpc.aio.ServicerContext):
        if not request.request_id or not request.prefill_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id and prefill_address are required")
        if (error := prefill_address_error(request.prefill_address)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        moved = await self.loop.run(lambda: self.loop.set_prefill(request.request_id, request.prefill_address))
        if not moved:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request_id={request.request_id!r} is not waiting for its KV here")
        return worker_pb2.SetPrefillResponse()

    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        found = await self.loop.run(lambda: self.loop.abort(request.request_id))
        if not found:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id={request.request_id!r} is not known here")
        return worker_pb2.AbortResponse()

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        try:
            snapshot = self.loop.snapshot()   # never waits on the engine thread (liveness != load)
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return worker_pb2.StatsResponse(**snapshot, fingerprint=self.fingerprint)
