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
worker, keeping its reservation, is told the new source (``DecodeSession.set_prefill``).

An attempt's life is two fields, each with one writer:

    Attempt.stage (how far it got; only forward, Dispatcher._reach):
        PREFILLING --D sends a token or the finish--------------------------> STREAMING
            '--SetPrefill finds the KV at D already--> PREFILLED --token-->'
        A local prefill starts at PREFILLED. Leaving PREFILLING releases P: its part is done.

    Attempt.outcome (how it ended; set once, Attempt.conclude: the first to see an end decides):
        None --> FINISHED    D sent the finish_reason (``_event``, as ``events`` reads D's stream)
             --> BROKEN      ``Attempt.broken`` says how, made where the break is seen: the decode
                             stream (``events``) or outside it (``_cut``: a worker removed or
                             drained, a Submit failed, a prefill replacement failed), which
                             cancels the stream. A cut counts only on a stream still open: one
                             that already ended (its finish or its error waiting to be read)
                             ends the attempt its own way.
             --> ABANDONED   the caller left before either (``_end``)

``_end`` closes an attempt once, whatever its outcome: it releases the workers it still holds
(their load at the registry) and stops one that did not finish at both workers. The retry
decision, ``_judge``, reads ``Attempt.broken`` (with the stage, and what the probe found).

A client's request id is a label: the workers see ``<label>.<16 hex>``, 64 random bits drawn per
request (os.urandom, half a microsecond), unique and unguessable, so a reused client id never
joins or aborts another client's request, and a peer holding the cluster secret cannot aim an
abort or a redirect at a request it has not seen (the caller keeps using its own id in
responses). Retries use ``<internal id>.retry<N>`` so a worker still cleaning up the old
attempt never sees a clash. A request that fails twice for the same reason (worker addresses
and ids aside) on different workers -- a poison request, not a bad worker -- is not tried on
more; a worker removed from the registry (or drained away) is not such a reason, nor a KV
transfer that broke (the decode worker marks it ``error_transient``: a link or a write, not the
request; ``max_attempts`` still bounds it). A worker's status outside ``RETRYABLE`` fails the
request at once. The client hears which role failed and why, never a worker's address (the log
line has it).

Conditional disaggregation: a prompt of at most ``local_prefill_max_tokens`` tokens (0: none)
goes to a decode worker alone (``GenerateRequest.local_prefill``), which computes it beside its
running batch; no prefill worker, no KV transfer. An attempt without a prefill worker has
``prefill=None`` and starts at ``Stage.PREFILLED``.

Cleanup of an unfinished attempt is synchronous (it runs while the caller is being cancelled):
cancel the request on D's session and abort it on P's (both only queue a message).
"""
from __future__ import annotations

import asyncio
import enum
import logging
import os
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import grpc

from engine.config import DEFAULT_MAX_TOKENS  # the engine's default when sampling.max_tokens is unset
from protos.limits import MAX_CLIENT_REQUEST_ID_CHARS, ROLES
from protos.streams import PeerFailure
from protos.tandem.v1 import worker_pb2
from router import errors
from router.admission import WaitingQueue
from router.policies import Policy
from router.registry import WorkerRegistry, WorkerState, cancel_requested
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


class Stage(enum.Enum):
    """How far an attempt got (``Attempt.stage``); only ``Dispatcher._reach`` moves it, forward."""

    PREFILLING = 1    # P has the prompt; its KV is being computed or is on its way to D
    PREFILLED = 2     # P's part is over before a token: a local prefill (no P), or the KV reached D
    STREAMING = 3     # D sent a token or the finish


class Outcome(enum.Enum):
    """How an attempt ended (``Attempt.outcome``), set once by ``Attempt.conclude``."""

    FINISHED = "finished"     # D sent the finish_reason
    BROKEN = "broken"         # ``Attempt.broken`` says how; ``Dispatcher._judge`` decides what follows
    ABANDONED = "abandoned"   # the caller left first (cancelled, or closed the stream)


@dataclass(frozen=True)
class Break:
    """How an attempt broke: what the retry decision reads. Made where the break is seen (see
    the module docstring)."""

    role: str                                 # the role that broke it
    failure: str                              # what happened, for the log (addresses and ids in it)
    lost: str | None = None                   # a worker removed or drained away: its fault, not the request's
    transient: bool = False                   # the decode worker said so (a KV transfer broke)
    error: grpc.aio.AioRpcError | None = None   # the worker's status: D's stream's, or P's answer to Submit


@dataclass(eq=False)
class Attempt:
    """One try of a request on one pair (the life cycle is in the module docstring)."""

    request_id: str
    prefill: WorkerState | None            # None: the decode worker prefills the prompt itself
    decode: WorkerState
    call: SessionCall                      # the request on D's session
    submit_request: worker_pb2.SubmitRequest | None   # what P was sent (None with a local prefill)
    stage: Stage
    outcome: Outcome | None = None
    broken: Break | None = None            # with Outcome.BROKEN

    def conclude(self, outcome: Outcome, broken: Break | None = None) -> bool:
        """Say how the attempt ended (``broken`` with BROKEN). The first call decides; a later
        one changes nothing and returns False."""
        assert (outcome is Outcome.BROKEN) == (broken is not None)
        if self.outcome is not None:
            return False
        self.outcome, self.broken = outcome, broken
        return True


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
    waiting: bool = True    # no token streamed yet: in ``Dispatcher.waiting``


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, prefill_policy: Policy, decode_policy: Policy,
                 max_attempts: int = 4, rpc_timeout_s: float = 30.0,
                 on_failover: Callable[[str], None] | None = None, failover_wait_s: float = 0.0,
                 local_prefill_max_tokens: int = 0, drain_move_after_s: float | None = None) -> None:
        self.registry = registry
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.max_attempts = max_attempts
        self.rpc_timeout_s = rpc_timeout_s
        self.on_failover = on_failover
        self.failover_wait_s = failover_wait_s
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.drain_move_after_s = drain_move_after_s
        self._movers: set[asyncio.Task] = set()        # drains waiting to move their streams (_move_streams)
        self.waiting = WaitingQueue()   # requests without their first token yet
        self._attempts: dict[str, set[Attempt]] = {}   # by worker address: the attempts holding it
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
        # The workers' id: the client's label made unique (clients may reuse theirs), never shown to
        # the client; Frontend.new_request_id makes a label only for a client that gave none.
        internal_id = f"{request_id[:MAX_CLIENT_REQUEST_ID_CHARS]}.{os.urandom(8).hex()}"
        logger.debug("request_id=%s is client request_id=%r", internal_id, request_id)
        first = self._start(internal_id, progress, sampling, set())
        self.waiting.enter(len(progress.prompt_token_ids))
        return Dispatch(internal_id, progress, sampling, first)

    def abandon(self, dispatch: Dispatch) -> None:
        """End a request whose ``events`` never ran (its caller was cancelled first): it is
        aborted at its workers. Nothing to do once ``events`` has begun."""
        attempt, dispatch.first = dispatch.first, None
        if attempt is not None:
            self._left_queue(dispatch, first_token=False)
            self._end(attempt)

    async def events(self, dispatch: Dispatch) -> AsyncGenerator[TokenEvent, None]:
        """Stream an opened request's tokens, failing over as needed; raises RouterError when it
        cannot complete."""
        first, dispatch.first = dispatch.first, None
        if first is None:
            raise RuntimeError("events() of a request already streamed or abandoned")
        progress = dispatch.progress
        avoid: set[str] = set()      # the workers broken attempts point at
        failures: set[str] = set()   # why earlier attempts failed, with addresses and ids left out
        try:
            attempt = first
            for attempt_no in range(self.max_attempts):
                if attempt_no:
                    await self._wait_for_workers(("decode",) if self._local(progress) else ROLES)
                    attempt = self._start(f"{dispatch.request_id}.retry{attempt_no}", progress, dispatch.sampling,
                                          avoid)
                try:
                    while responses := await attempt.call.take():
                        yield self._event(dispatch, attempt, responses)
                        if attempt.outcome is Outcome.FINISHED:
                            return
                    attempt.conclude(Outcome.BROKEN, Break("decode", "the decode stream ended without a finish_reason"))
                except grpc.aio.AioRpcError as exc:
                    attempt.conclude(Outcome.BROKEN, Break(
                        "decode", f"decode stream: {exc.code().name}: {exc.details()}", error=exc,
                        transient=isinstance(exc, PeerFailure) and exc.transient))
                except asyncio.CancelledError:
                    if attempt.outcome is not Outcome.BROKEN or cancel_requested():
                        raise   # the caller's own cancellation, not a cut
                finally:
                    self._end(attempt)
                avoid |= await self._judge(attempt, dispatch.request_id, failures)
                if len(progress.output_token_ids) >= progress.max_tokens:
                    # The stream broke after the last token but before its finish message.
                    yield TokenEvent([], [], "length", len(progress.prompt_token_ids),
                                     len(progress.output_token_ids))
                    return
                self._failing_over(attempt, dispatch)
            raise errors.unavailable(f"the request failed on {self.max_attempts} worker pairs")
        finally:
            if dispatch.waiting:
                self._left_queue(dispatch, first_token=False)

    @property
    def num_waiting(self) -> int:
        return self.waiting.num_requests

    def _left_queue(self, dispatch: Dispatch, first_token: bool) -> None:
        dispatch.waiting = False
        self.waiting.leave(len(dispatch.progress.prompt_token_ids), first_token)

    def _event(self, dispatch: Dispatch, attempt: Attempt, responses: list[worker_pb2.GenerateResponse]) -> TokenEvent:
        """One event for every message of D's stream since the last (one per engine step while
        the caller keeps up; more when it is busy); a finish_reason concludes the attempt."""
        progress, response = dispatch.progress, responses[-1]
        if len(responses) == 1:
            token_ids = list(response.token_ids)
            logprobs = list(response.logprobs)
        else:
            token_ids = [t for r in responses for t in r.token_ids]
            logprobs = [lp for r in responses for lp in r.logprobs]
        finish_reason = response.finish_reason
        if token_ids and dispatch.waiting:
            self._left_queue(dispatch, first_token=True)
        if token_ids or finish_reason:
            self._reach(attempt, Stage.STREAMING)
        progress.output_token_ids += token_ids
        event = TokenEvent(token_ids, logprobs)
        if finish_reason:
            attempt.conclude(Outcome.FINISHED)
            event.finish_reason = finish_reason
            event.num_prompt_tokens = len(progress.prompt_token_ids)
            event.num_output_tokens = len(progress.output_token_ids)
            event.num_cached_tokens = response.num_cached_tokens
        return event

    def _failing_over(self, attempt: Attempt, dispatch: Dispatch) -> None:
        """Log a broken attempt the request goes on from, and count it (``on_failover``)."""
        failure = attempt.broken.failure if attempt.broken is not None else ""
        logger.warning("failing over request_id=%s after %d output tokens: %s", dispatch.request_id,
                       len(dispatch.progress.output_token_ids), errors.clip(failure, errors.WORKER_DETAIL_CHARS))
        if self.on_failover is not None:
            self.on_failover(failure)

    async def close(self) -> None:
        """Wait for the background tasks: failed Submits being probed, prefill replacements
        (call after the servers stopped taking requests)."""
        for task in list(self._movers):
            task.cancel()
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
        assert isinstance(decode.session, DecodeSession)
        if prefill is None:
            call = decode.session.generate(worker_pb2.GenerateRequest(
                request_id=attempt_id, prompt_token_ids=prompt, sampling=params, local_prefill=True))
            attempt = Attempt(attempt_id, None, decode, call, None, Stage.PREFILLED)
            self._hold(attempt, decode)
            return attempt
        call = decode.session.generate(worker_pb2.GenerateRequest(
            request_id=attempt_id, prompt_token_ids=prompt, sampling=params, prefill_address=prefill.address))
        submit_request = worker_pb2.SubmitRequest(
            request_id=attempt_id, prompt_token_ids=prompt, sampling=params, decode_address=decode.address)
        attempt = Attempt(attempt_id, prefill, decode, call, submit_request, Stage.PREFILLING)
        self._submit(attempt, prefill, submit_request)
        self._hold(attempt, prefill)
        self._hold(attempt, decode)
        return attempt

    def _submit(self, attempt: Attempt, prefill: WorkerState, request: worker_pb2.SubmitRequest) -> None:
        assert isinstance(prefill.session, PrefillSession)
        prefill.session.submit(request, self.rpc_timeout_s).add_done_callback(
            lambda answer: self._submitted(attempt, prefill, answer))

    def _submitted(self, attempt: Attempt, prefill: WorkerState, answer: asyncio.Future) -> None:
        if answer.cancelled() or answer.exception() is None or attempt.outcome is not None or attempt.call.done():
            return
        self._spawn(self._submit_failed(attempt, prefill, answer.exception()))

    async def _submit_failed(self, attempt: Attempt, prefill: WorkerState, exc: grpc.aio.AioRpcError) -> None:
        if exc.code() in RETRYABLE and not await self.registry.probe(prefill.address):
            return  # removed: _worker_removed moves the prompt to another prefill worker
        self._cut(attempt, Break("prefill", f"Submit to {prefill.address}: {exc.code().name}: {exc.details()}",
                                 error=exc))

    @staticmethod
    def _cut(attempt: Attempt, brk: Break) -> None:
        """Break ``attempt`` from outside its stream: its stream is cancelled, unless it ended
        already (then its own end is the outcome), or the attempt has an outcome already."""
        if attempt.outcome is None and attempt.call.cancel():
            attempt.conclude(Outcome.BROKEN, brk)

    def _reach(self, attempt: Attempt, stage: Stage) -> None:
        """Move ``attempt`` forward to ``stage``; leaving PREFILLING releases P (its part is done)."""
        if stage.value <= attempt.stage.value:
            return
        if attempt.stage is Stage.PREFILLING:
            assert attempt.prefill is not None   # a local prefill starts at PREFILLED
            self._release(attempt, attempt.prefill)
        attempt.stage = stage

    def _hold(self, attempt: Attempt, worker: WorkerState) -> None:
        """``attempt`` involves ``worker`` now: its load at the registry, and its removal reaches it."""
        self.registry.hold(worker)
        self._attempts.setdefault(worker.address, set()).add(attempt)

    def _release(self, attempt: Attempt, worker: WorkerState) -> None:
        self.registry.release(worker)
        self._attempts.get(worker.address, set()).discard(attempt)

    def _end(self, attempt: Attempt) -> None:
        """Close ``attempt`` (once: when ``events`` leaves it, or ``abandon``): release the workers
        it holds; one that did not finish is stopped at both."""
        attempt.conclude(Outcome.ABANDONED)   # unless it finished or broke
        if attempt.stage is Stage.PREFILLING:
            assert attempt.prefill is not None
            self._release(attempt, attempt.prefill)
        self._release(attempt, attempt.decode)
        if attempt.outcome is Outcome.FINISHED:
            return
        attempt.call.cancel()   # D aborts it: the abort follows the start on its session stream
        # Abort at P at once too, on its session after the Submit; the decode worker also aborts
        # at P when the request is cancelled there, but that takes a hop and the request may
        # not have reached D yet.
        prefill = attempt.prefill
        if prefill is not None and not prefill.removed:
            assert isinstance(prefill.session, PrefillSession)
            prefill.session.abort(attempt.request_id)

    # -- after a break ----------------------------------------------------------------------
    async def _judge(self, attempt: Attempt, request_id: str, failures: set[str]) -> set[str]:
        """The retry decision on a BROKEN attempt, read from ``attempt.broken``: raises when the
        request is not to be tried again (a worker's status that no other pair would change, or a
        poison request: see the module docstring), else returns the workers the next attempt
        avoids. Probes the pair first, so a dead worker is out before the next pick."""
        brk = attempt.broken
        assert attempt.outcome is Outcome.BROKEN and brk is not None
        if brk.error is not None and brk.error.code() not in RETRYABLE:
            raise errors.from_worker(brk.error.code(), brk.error.details() or "")
        suspects = self._suspects(attempt, brk)
        # A killed worker breaks the stream before the registry knows; the probe removes it:
        # the worker's fault, never a poison request's.
        removed = await self._diagnose(attempt)
        if brk.lost is None and removed is None and not brk.transient:
            reason = self._reason(brk.failure, attempt, request_id)
            if reason in failures:
                logger.warning("request_id=%s failed twice for the same reason; not retrying: %s",
                               request_id, errors.clip(brk.failure, errors.WORKER_DETAIL_CHARS))
                detail = errors.without_addresses(errors.clip(reason, errors.WORKER_DETAIL_CHARS),
                                                  [w.address for w in self.registry.all()])
                raise errors.internal(f"the request failed twice for the same reason on different "
                                      f"{brk.role} workers; not retrying: {detail}")
            failures.add(reason)
        return suspects

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
        """The workers a break points at: a lost one; P too when its Submit failed or nothing streamed."""
        if brk.lost is not None:
            return {brk.lost}
        if attempt.prefill is not None and (brk.role == "prefill" or attempt.stage is not Stage.STREAMING):
            return {attempt.prefill.address, attempt.decode.address}
        return {attempt.decode.address}

    async def _diagnose(self, attempt: Attempt) -> str | None:
        """Probe the pair after a break so a dead worker is out before the next pick; the address
        of one of them that is removed by now (None: both stay)."""
        probes = [self.registry.probe(attempt.decode.address)]
        if attempt.prefill is not None and attempt.prefill.address != attempt.decode.address:
            probes.append(self.registry.probe(attempt.prefill.address))
        await asyncio.gather(*probes)
        return next((w.address for w in (attempt.decode, attempt.prefill) if w is not None and w.removed), None)

    # -- a worker leaves --------------------------------------------------------------------
    def _worker_removed(self, worker: WorkerState) -> None:
        self.prefill_policy.forget(worker.address)
        self.decode_policy.forget(worker.address)
        for attempt in list(self._attempts.pop(worker.address, ())):
            if attempt.decode is worker:
                self._cut(attempt, Break("decode", f"worker {worker.address} was removed", lost=worker.address))
            elif attempt.stage is Stage.PREFILLING:
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
                  if attempt.decode is worker and attempt.prefill is not None and attempt.stage is not Stage.STREAMING]
        if moving:
            logger.info("decode worker %s drains: %d requests without a first token move to other decode workers",
                        worker.address, len(moving))
        for attempt in moving:
            self._cut(attempt, Break("decode", f"worker {worker.address} drains: moved before its first token",
                                     lost=worker.address))
        if self.drain_move_after_s is not None:
            mover = self._spawn(self._move_streams(worker, self.drain_move_after_s))
            self._movers.add(mover)
            mover.add_done_callback(self._movers.discard)

    async def _move_streams(self, worker: WorkerState, after_s: float) -> None:
        """``after_s`` into a decode worker's drain, the streams it still runs resume on other
        pairs as a failover does (prompt + the tokens streamed, prefilled again: a recompute, as
        vLLM's preemption), so a scale-down ends then, not when its longest stream ends."""
        await asyncio.sleep(after_s)
        if worker.removed or not self.registry.healthy("decode"):
            return
        moving = [attempt for attempt in self._attempts.get(worker.address, ()) if attempt.decode is worker]
        if moving:
            logger.info("decode worker %s drained for %.1f s: %d running streams move to other decode workers",
                        worker.address, after_s, len(moving))
        for attempt in moving:
            self._cut(attempt, Break("decode", f"worker {worker.address} drains: moved after {after_s:g} s",
                                     lost=worker.address))

    async def _replace_prefill(self, attempt: Attempt, dead: WorkerState) -> None:
        """Re-submit to another prefill worker and point the decode worker at it
        (docs/architecture.md#failure-handling); on any failure fall back to a whole new pair."""
        assert attempt.submit_request is not None   # a local prefill has no prefill worker to lose
        lost = Break("prefill", f"worker {dead.address} was removed", lost=dead.address)
        try:
            workers = [w for w in self.registry.healthy("prefill") if w.address != dead.address]
            if not workers:
                raise errors.unavailable("no other prefill worker is available")
            new = self.prefill_policy.choose(workers, list(attempt.submit_request.prompt_token_ids))
            assert isinstance(attempt.decode.session, DecodeSession)
            await attempt.decode.session.set_prefill(attempt.request_id, new.address, self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND and attempt.outcome is None:
                self._reach(attempt, Stage.PREFILLED)   # the KV already landed: the decode worker carries on
                return
            self._cut(attempt, lost)
            return
        except errors.RouterError:
            self._cut(attempt, lost)
            return
        if attempt.outcome is not None or attempt.stage is not Stage.PREFILLING:
            return   # over, or the KV reached D meanwhile
        logger.warning("prefill worker %s lost: request_id=%s moves to %s, keeping its decode reservation",
                       dead.address, attempt.request_id, new.address)
        if self.on_failover is not None:
            self.on_failover(f"prefill worker {dead.address} was removed")
        attempt.prefill = new
        self._hold(attempt, new)
        self._submit(attempt, new, attempt.submit_request)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task
