"""The request flow at the router: pick a prefill/decode pair, open the stream, fail over.

Runs on the router's asyncio loop. One attempt = the request started on D's session stream and
submitted on P's, concurrently, with the same request id (router/session.py: one ``Session``
stream per worker carries all of the router's requests there). Tokens stream from D. When an
attempt breaks — P or D removed by the registry, the stream ends with a transient gRPC error,
or Submit fails transiently — both workers are probed (a dead one is removed) and
the request is dispatched again to a fresh pair with prompt + the tokens already streamed and
the remaining ``max_tokens``, so the caller sees one unbroken token stream with nothing
duplicated or missing. A prefill worker lost while its request still waits for KV is replaced
in place (docs/architecture.md#failure-handling): the prompt is re-submitted to another prefill worker and the decode
worker, keeping its reservation, is told the new source (``DecodeWorker.SetPrefill``).

A client's request id is a label: the workers see ``<label>.<16 hex>``, 64 random bits drawn per
request (os.urandom, half a microsecond), unique and unguessable, so a reused client id never
joins or aborts another client's request, and a peer holding the cluster secret cannot aim an
abort or a redirect at a request it has not seen (the caller keeps using its own id in
responses). Retries use ``<internal id>.retry<N>`` so a worker still cleaning up the old
attempt never sees a clash. A request that fails twice for the same reason (worker addresses
and ids aside) on different workers -- a poison request, not a bad worker -- is not tried on
more; a worker removed from the registry is not such a reason, nor a KV transfer that broke (the
decode worker marks it ``error_transient``: a link or a write, not the request; ``max_attempts``
still bounds it). The client hears which role
failed and why, never a worker's address (the log line has it).

Conditional disaggregation: a prompt of at most ``local_prefill_max_tokens`` tokens (0: none)
goes to a decode worker alone (``GenerateRequest.local_prefill``), which computes it beside its
running batch; no prefill worker, no KV transfer. An attempt without a prefill worker has
``prefill=None`` and ``prefill_done`` from the start.

Cleanup of an unfinished attempt is synchronous (it runs while the caller is being cancelled):
cancel the request on D's session and abort it on P's (both only queue a message).
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace

import grpc

from engine.config import DEFAULT_MAX_TOKENS  # the engine's default when sampling.max_tokens is unset
from protos.limits import MAX_CLIENT_REQUEST_ID_CHARS, ROLES
from protos.streams import PeerFailure
from protos.tandem.v1 import worker_pb2
from router import errors
from router.policies import Policy
from router.registry import WorkerRegistry, WorkerState
from router.session import DecodeSession, PrefillSession, SessionCall

logger = logging.getLogger(__name__)
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass
class TokenEvent:
    """New tokens from the decode stream; the last event has ``finish_reason`` and the counts."""

    token_ids: list[int]
    logprobs: list[worker_pb2.TokenLogprobs]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class Break:
    """How an attempt broke: the one value the retry decision reads. Made where the break is
    seen: the decode stream (in ``events``), or from outside it (a worker removed, a failed
    Submit), which then cancels the stream."""

    role: str                                 # the role that broke it
    failure: str                              # what happened, for the log (addresses and ids in it)
    lost: str | None = None                   # a worker the registry removed: its fault, not the request's
    transient: bool = False                   # the decode worker said so (a KV transfer broke)
    submit_error: grpc.aio.AioRpcError | None = None   # the Submit's own error


@dataclass(eq=False)
class Attempt:
    request_id: str
    prefill: WorkerState | None        # None: the decode worker prefills the prompt itself
    decode: WorkerState
    call: SessionCall | None = None
    submit_request: worker_pb2.SubmitRequest | None = None
    broken: Break | None = None        # set once, from outside the stream (Dispatcher._cut)
    prefill_done: bool = False         # first token seen (or attempt over): P no longer involved
    streamed: bool = False             # D streamed something: P did its part
    finished: bool = False


@dataclass
class _Progress:
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Dispatch:
    """A request ``Dispatcher.open`` started: its id at the workers, its progress, its first
    attempt until ``events`` takes it."""
    request_id: str
    progress: _Progress
    sampling: worker_pb2.SamplingParams
    first: Attempt | None


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, prefill_policy: Policy, decode_policy: Policy,
                 max_attempts: int = 4, rpc_timeout_s: float = 30.0,
                 on_failover: Callable[[str], None] | None = None, failover_wait_s: float = 0.0,
                 local_prefill_max_tokens: int = 0) -> None:
        self.registry = registry
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.max_attempts = max_attempts
        self.rpc_timeout_s = rpc_timeout_s
        self.on_failover = on_failover
        self.failover_wait_s = failover_wait_s
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.num_waiting = 0          # requests without their first token yet
        self._attempts: dict[str, set[Attempt]] = {}
        self._background: set[asyncio.Task] = set()
        registry.on_removed(self._worker_removed)
        registry.on_drained(self._worker_drained)

    # -- public -----------------------------------------------------------------------------

    def open(self, request_id: str, prompt_token_ids: list[int], sampling: worker_pb2.SamplingParams) -> Dispatch:
        """Start the request's first attempt now (its start is queued on the workers' sessions);
        raises RouterError when no worker can take it. ``request_id`` is the client's label; the
        workers get a unique id made from it. Stream it with ``events``, or give it up with
        ``abandon`` if that never runs."""
        progress = _Progress(list(prompt_token_ids),
                             sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS)
        internal_id = f"{request_id[:MAX_CLIENT_REQUEST_ID_CHARS]}.{os.urandom(8).hex()}"
        logger.debug("request_id=%s is client request_id=%r", internal_id, request_id)
        first = self._start(internal_id, progress, sampling, set())
        self.num_waiting += 1
        return Dispatch(internal_id, progress, sampling, first)

    def abandon(self, dispatch: Dispatch) -> None:
        """End a request whose ``events`` never ran (its caller was cancelled first): it is
        aborted at its workers. Nothing to do once ``events`` has begun."""
        attempt, dispatch.first = dispatch.first, None
        if attempt is not None:
            self.num_waiting -= 1
            self._end(attempt)

    async def events(self, dispatch: Dispatch) -> AsyncGenerator[TokenEvent, None]:
        """Stream an opened request's tokens, failing over as needed; raises RouterError when it
        cannot complete."""
        first, dispatch.first = dispatch.first, None
        if first is None:
            raise RuntimeError("events() of a request already streamed or abandoned")
        request_id, progress, sampling = dispatch.request_id, dispatch.progress, dispatch.sampling
        waiting = True
        avoid: set[str] = set()
        failures: set[str] = set()   # why earlier attempts failed, with addresses and ids left out
        try:
            for attempt_no in range(self.max_attempts):
                attempt_id = request_id if attempt_no == 0 else f"{request_id}.retry{attempt_no}"
                if attempt_no:
                    await self._wait_for_workers(("decode",) if self._local(progress) else ROLES)
                    attempt = self._start(attempt_id, progress, sampling, avoid)
                else:
                    attempt = first
                try:
                    while responses := await attempt.call.take():
                        # One event for every message that came since the last (one per engine
                        # step while the caller keeps up; more when it is busy).
                        response = responses[-1]
                        if len(responses) == 1:
                            token_ids = list(response.token_ids)
                            logprobs = list(response.logprobs)
                        else:
                            token_ids = [t for r in responses for t in r.token_ids]
                            logprobs = [lp for r in responses for lp in r.logprobs]
                        finish_reason = response.finish_reason
                        if token_ids and waiting:
                            waiting = False
                            self.num_waiting -= 1
                        if token_ids or finish_reason:
                            attempt.streamed = True
                            self._prefill_done(attempt)
                        progress.output_token_ids += token_ids
                        event = TokenEvent(token_ids, logprobs)
                        if finish_reason:
                            attempt.finished = True
                            event.finish_reason = finish_reason
                            event.num_prompt_tokens = len(progress.prompt_token_ids)
                            event.num_output_tokens = len(progress.output_token_ids)
                            event.num_cached_tokens = response.num_cached_tokens
                        yield event
                        if attempt.finished:
                            return
                    brk = Break("decode", "the decode stream ended without a finish_reason")
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in RETRYABLE:
                        raise errors.from_worker(exc.code(), exc.details() or "") from None
                    brk = Break("decode", f"decode stream: {exc.code().name}: {exc.details()}",
                                transient=isinstance(exc, PeerFailure) and exc.transient)
                except asyncio.CancelledError:
                    if attempt.broken is None or asyncio.current_task().cancelling():
                        raise
                    brk = attempt.broken
                    error = brk.submit_error
                    if error is not None and error.code() not in RETRYABLE:
                        raise errors.from_worker(error.code(), error.details() or "") from None
                finally:
                    self._end(attempt)
                if brk.lost is None and attempt.broken is not None and attempt.broken.lost is not None:
                    brk = replace(brk, lost=attempt.broken.lost)   # removed while its stream broke
                avoid |= self._suspects(attempt, brk)
                await self._diagnose(attempt)
                if brk.lost is None:
                    # A killed worker breaks the stream before the registry knows; the probe
                    # just now removed it: the worker's fault, never a poison request's.
                    brk = replace(brk, lost=next((w.address for w in (attempt.decode, attempt.prefill)
                                                  if w is not None and w.removed), None))
                if brk.lost is None and not brk.transient:
                    reason = self._reason(brk.failure, attempt, request_id)
                    if reason in failures:
                        logger.warning("request_id=%s failed twice for the same reason; not retrying: %s",
                                       request_id, errors.clip(brk.failure, errors.WORKER_DETAIL_CHARS))
                        detail = errors.without_addresses(errors.clip(reason, errors.WORKER_DETAIL_CHARS),
                                                          [w.address for w in self.registry.all()])
                        raise errors.internal(f"the request failed twice for the same reason on different "
                                              f"{brk.role} workers; not retrying: {detail}")
                    failures.add(reason)
                if len(progress.output_token_ids) >= progress.max_tokens:
                    # The stream broke after the last token but before its finish message.
                    yield TokenEvent([], [], "length", len(progress.prompt_token_ids),
                                     len(progress.output_token_ids))
                    return
                logger.warning("failing over request_id=%s after %d output tokens: %s", request_id,
                               len(progress.output_token_ids), errors.clip(brk.failure, errors.WORKER_DETAIL_CHARS))
                if self.on_failover is not None:
                    self.on_failover(brk.failure)
            raise errors.unavailable(f"the request failed on {self.max_attempts} worker pairs")
        finally:
            if waiting:
                self.num_waiting -= 1

    async def close(self) -> None:
        """Wait for the background tasks: failed Submits being probed, prefill replacements
        (call after the servers stopped taking requests)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def _wait_for_workers(self, roles: tuple[str, ...]) -> None:
        """Before a retry: give a restarting worker ``failover_wait_s`` to come back when no
        worker of a role the attempt needs is left (then ``_pick`` fails the request as unavailable)."""
        for role in roles:
            if not self.registry.healthy(role) and self.failover_wait_s > 0:
                logger.info("no healthy %s worker; waiting up to %.0f s for one", role, self.failover_wait_s)
                try:
                    await self.registry.wait_healthy(role, 1, self.failover_wait_s)
                except asyncio.TimeoutError:
                    return

    # -- one attempt ------------------------------------------------------------------------
    def _local(self, progress: _Progress) -> bool:
        """Whether the next attempt's prompt (the prompt plus what was streamed) is short
        enough for its decode worker to prefill it."""
        return len(progress.prompt_token_ids) + len(progress.output_token_ids) <= self.local_prefill_max_tokens


    def _pick(self, role: str, policy: Policy, prompt: list[int], avoid: set[str]) -> WorkerState:
        workers = self.registry.healthy(role)
        if not workers:
            raise errors.unavailable(f"no {role} worker is available")
        # A retry avoids the workers of broken attempts while others are left (they may answer
        # heartbeats and still fail requests).
        fresh = [w for w in workers if w.address not in avoid] if avoid else workers
        return policy.choose(fresh or workers, prompt)

    def _start(self, attempt_id: str, progress: _Progress, sampling: worker_pb2.SamplingParams,
               avoid: set[str]) -> Attempt:
        # A first attempt sends the prepared prompt and params as they are (the messages copy
        # them); a retry resumes after the output streamed so far.
        prompt, params = progress.prompt_token_ids, sampling
        if progress.output_token_ids or not sampling.HasField("max_tokens"):
            prompt = prompt + progress.output_token_ids
            params = worker_pb2.SamplingParams()
            params.CopyFrom(sampling)
            params.max_tokens = progress.max_tokens - len(progress.output_token_ids)
            # The prompt ends with the output streamed so far: grammar, seed and penalties resume after it.
            params.num_resumed_tokens = len(progress.output_token_ids)
        prefill = None if self._local(progress) else self._pick("prefill", self.prefill_policy, prompt, avoid)
        decode = self._pick("decode", self.decode_policy, prompt, avoid)
        attempt = Attempt(attempt_id, prefill, decode)
        assert isinstance(decode.session, DecodeSession)
        if prefill is None:
            attempt.prefill_done = True
            attempt.call = decode.session.generate(worker_pb2.GenerateRequest(
                request_id=attempt_id, prompt_token_ids=prompt, sampling=params, local_prefill=True))
            workers: tuple[WorkerState, ...] = (decode,)
        else:
            attempt.call = decode.session.generate(worker_pb2.GenerateRequest(
                request_id=attempt_id, prompt_token_ids=prompt, sampling=params, prefill_address=prefill.address))
            attempt.submit_request = worker_pb2.SubmitRequest(
                request_id=attempt_id, prompt_token_ids=prompt, sampling=params, decode_address=decode.address)
            self._submit(attempt, attempt.submit_request)
            workers = (prefill, decode)
        for worker in workers:
            worker.num_inflight += 1
            worker.num_requests += 1
            self._attempts.setdefault(worker.address, set()).add(attempt)
        return attempt

    def _submit(self, attempt: Attempt, request: worker_pb2.SubmitRequest) -> None:
        prefill = attempt.prefill
        assert prefill is not None
        assert isinstance(prefill.session, PrefillSession)
        prefill.session.submit(request, self.rpc_timeout_s).add_done_callback(
            lambda answer: self._submitted(attempt, prefill, answer))

    def _submitted(self, attempt: Attempt, prefill: WorkerState, answer: asyncio.Future) -> None:
        if answer.cancelled() or answer.exception() is None or attempt.finished or attempt.call.done():
            return
        self._spawn(self._submit_failed(attempt, prefill, answer.exception()))

    async def _submit_failed(self, attempt: Attempt, prefill: WorkerState, exc: grpc.aio.AioRpcError) -> None:
        if exc.code() in RETRYABLE and not await self.registry.probe(prefill.address):
            return  # removed: _worker_removed moves the prompt to another prefill worker
        if attempt.finished or attempt.call.done():
            return
        self._cut(attempt, Break("prefill", f"Submit to {prefill.address}: {exc.code().name}: {exc.details()}",
                                 submit_error=exc))

    @staticmethod
    def _cut(attempt: Attempt, brk: Break) -> None:
        """Break ``attempt`` from outside its stream: the first break is the one that counts."""
        if attempt.broken is None:
            attempt.broken = brk
            attempt.call.cancel()

    def _prefill_done(self, attempt: Attempt) -> None:
        if not attempt.prefill_done:
            attempt.prefill_done = True
            assert attempt.prefill is not None   # a local prefill starts done
            attempt.prefill.num_inflight -= 1
            self._attempts.get(attempt.prefill.address, set()).discard(attempt)

    def _end(self, attempt: Attempt) -> None:
        self._prefill_done(attempt)
        attempt.decode.num_inflight -= 1
        self._attempts.get(attempt.decode.address, set()).discard(attempt)
        if attempt.finished:
            return
        attempt.finished = True
        attempt.call.cancel()   # D aborts it: the abort follows the start on its session stream
        # Abort at P at once too, on its session after the Submit; the decode worker also aborts
        # at P when the request is cancelled there, but that takes a hop and the request may
        # not have reached D yet.
        prefill = attempt.prefill
        if prefill is not None and not prefill.removed:
            assert isinstance(prefill.session, PrefillSession)
            prefill.session.abort(attempt.request_id)

    @staticmethod
    def _reason(failure: str, attempt: Attempt, request_id: str) -> str:
        """``failure`` without what differs between attempts: the workers and the attempt's id."""
        workers = [w.address for w in (attempt.prefill, attempt.decode) if w is not None]
        for name, value in ((attempt.request_id, "<request>"), (request_id, "<request>"),
                            *((address, "<worker>") for address in workers)):
            failure = failure.replace(name, value)
        return failure

    @staticmethod
    def _suspects(attempt: Attempt, brk: Break) -> set[str]:
        if brk.lost is not None:
            return {brk.lost}
        if attempt.prefill is not None and (brk.submit_error is not None or not attempt.streamed):
            return {attempt.prefill.address, attempt.decode.address}
        return {attempt.decode.address}

    async def _diagnose(self, attempt: Attempt) -> None:
        """Probe the pair after a break so a dead worker is out before the next pick."""
        probes = [self.registry.probe(attempt.decode.address)]
        if attempt.prefill is not None and attempt.prefill.address != attempt.decode.address:
            probes.append(self.registry.probe(attempt.prefill.address))
        await asyncio.gather(*probes)

    def _worker_removed(self, worker: WorkerState) -> None:
        self.prefill_policy.forget(worker.address)
        self.decode_policy.forget(worker.address)
        for attempt in list(self._attempts.pop(worker.address, ())):
            if attempt.decode is worker:
                self._cut(attempt, Break("decode", f"worker {worker.address} was removed", lost=worker.address))
            elif not attempt.prefill_done:
                # Keep the decode worker's reservation: move the prompt to another prefill worker.
                self._spawn(self._replace_prefill(attempt, worker))

    def _worker_drained(self, worker: WorkerState) -> None:
        """A decode worker scaled down: its requests without a token yet (their prompt queued at
        a prefill worker, or its KV on the way) start again on another pair now, so the drain
        waits only for the streams it runs, not for a prefill backlog. Their prefill work so far is
        redone; one that streams already stays. Not when no other decode worker is routable."""
        if worker.role != "decode" or not self.registry.healthy("decode"):
            return
        moving = [attempt for attempt in self._attempts.get(worker.address, ())
                  if attempt.decode is worker and attempt.prefill is not None and not attempt.streamed]
        if moving:
            logger.info("decode worker %s drains: %d requests without a first token move to other decode workers",
                        worker.address, len(moving))
        for attempt in moving:
            self._cut(attempt, Break("decode", f"worker {worker.address} drains: moved before its first token",
                                     lost=worker.address))

    async def _replace_prefill(self, attempt: Attempt, dead: WorkerState) -> None:
        """Re-submit to another prefill worker and point the decode worker at it
        (docs/architecture.md#failure-handling); on any failure fall back to a whole new pair."""
        try:
            workers = [w for w in self.registry.healthy("prefill") if w.address != dead.address]
            if not workers:
                raise errors.unavailable("no other prefill worker is available")
            new = self.prefill_policy.choose(workers, list(attempt.submit_request.prompt_token_ids))
            await attempt.decode.stub.SetPrefill(worker_pb2.SetPrefillRequest(
                request_id=attempt.request_id, prefill_address=new.address), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND and not attempt.finished:
                attempt.prefill_done = True  # the KV already landed: the decode worker carries on
                return
            self._cut(attempt, Break("prefill", f"worker {dead.address} was removed", lost=dead.address))
            return
        except errors.RouterError:
            self._cut(attempt, Break("prefill", f"worker {dead.address} was removed", lost=dead.address))
            return
        if attempt.finished:
            return
        logger.warning("prefill worker %s lost: request_id=%s moves to %s, keeping its decode reservation",
                       dead.address, attempt.request_id, new.address)
        if self.on_failover is not None:
            self.on_failover(f"prefill worker {dead.address} was removed")
        attempt.prefill = new
        new.num_inflight += 1
        new.num_requests += 1
        self._attempts.setdefault(new.address, set()).add(attempt)
        self._submit(attempt, attempt.submit_request)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task
