"""The decode role's engine thread: reserve blocks, receive KV, decode in a continuous batch.

Runs on the decode worker's engine thread. A request waits in the pre-allocation queue until
blocks for its prompt (plus one) fit beside the output room running requests are expected to
need (SGLang's new_token_ratio, scaled by schedule_conservativeness). Then the blocks are
announced to kvtransfer, the prefill worker is told the destination, and when every layer and
the first token have landed the request joins the decode batch. Out of blocks mid-decode, the
scheduler retracts the request with the least progress and recomputes it here later.

Stream events (tokens, finishes, errors) are not handed to their streams one by one: the loop
collects them and passes each batch -- all of one step's tokens, or what the commands and
transfer polls before the step produced -- to ``deliver`` in one call, so the gRPC side pays
one cross-thread wakeup per step, not one per running request.

Under tensor parallelism this is rank 0: every rank has a receiver over its own KV heads
(decode_worker/ranks.py), the prefill worker gets all their descriptors in one blob, and
reservations, cancels and polls are mirrored on every rank, so a request starts decoding only
once every rank's share of its KV has landed.

A request the router sends without a prefill worker (``local_prefill``: conditional
disaggregation, for short prompts) skips all of that: it goes into the engine's own waiting
queue and its prompt is computed here in chunks beside the running batch, as a colocated engine
would.
"""
from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kvtransfer
from decode_worker.ops import POLL_FIELDS, Cancel, Expect, Fence, Poll, ReceivePoll, Release
from decode_worker.ranks import DecodeRank
from engine.config import SamplingParams
from engine.llm_engine import LLMEngine, StepOutput
from engine.math_utils import cdiv
from worker.config import WorkerConfig
from worker.loop import EngineLoop
from worker.metrics import WorkerMetrics
from worker.tp_role import MirroredOps

logger = logging.getLogger(__name__)


@dataclass
class StreamEvent:
    """What the engine thread hands a request's stream: tokens, a finish, or an error."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None          # the request failed; the stream ends with UNAVAILABLE
    transient: bool = False           # ... because its KV transfer broke, not because of the request
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


Sink = Callable[[StreamEvent], None]
EventBatch = list[tuple[Sink, StreamEvent]]


def deliver_in_place(batch: EventBatch) -> None:
    """The default ``DecodeLoop.deliver``: call each sink on the engine thread (in-process use)."""
    for sink, event in batch:
        sink(event)


class DecodeState(enum.Enum):
    """Where a request is on this worker (``DecodeJob.state``; ``DecodeLoop`` opens with the life
    cycle). Only ``DecodeLoop._move`` changes it, and the loop's per-stage indexes with it."""

    PREALLOCATING = "preallocating"   # waiting in the pre-allocation queue for blocks
    TRANSFERRING = "transferring"     # blocks reserved, the prefill worker is writing them
    PREFILLING = "prefilling"         # local prefill: the engine computes its prompt here
    RUNNING = "running"               # in the engine's running batch, streaming tokens
    RELEASING = "releasing"           # ended mid-transfer: its blocks are freed once no writer can touch them


@dataclass
class DecodeJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_address: str                      # "" = local prefill (no prefill worker)
    sink: Sink                                # called by DecodeLoop.deliver with this job's events
    arrival_s: float = field(default_factory=time.monotonic)
    state: DecodeState = DecodeState.PREALLOCATING
    block_ids: list[int] = field(default_factory=list)        # reserved: prompt + first token
    transfer_block_ids: list[int] = field(default_factory=list)  # the ones the prompt's KV fills
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    last_token_s: float | None = None
    reserved_s: float | None = None


class DecodeLoop(EngineLoop):
    """A request's life here, one ``DecodeJob.state`` (``_move`` is the only writer):

        PREALLOCATING --_admit--> TRANSFERRING --_poll_transfers--> RUNNING --finish--> (gone)
        PREFILLING (local prefill) --first token--> RUNNING
        TRANSFERRING --abort / transfer failed--> RELEASING --no writer left--> (gone)

    Any other stage ends at once on an abort or a failure. ``jobs`` holds every request in a
    stage, including RELEASING ones (their id cannot be reused until then); the per-stage views
    (``prealloc`` in arrival order, ``transferring``, ``releasing``) are indexes of that field,
    kept by ``_move`` alone."""

    def __init__(self, engine: LLMEngine, config: WorkerConfig, metrics: WorkerMetrics,
                 receiver: kvtransfer.Receiver,
                 send_destination: Callable[[DecodeJob, bytes], None], descriptor: bytes | None = None,
                 deliver: Callable[[EventBatch], None] = deliver_in_place) -> None:
        """``descriptor``: what the prefill worker writes to (default: ``receiver``'s; with TP,
        every rank's, from ``kvtransfer.join_descriptors``). ``deliver``: called on the engine
        thread with each batch of events, in order (the gRPC servicer's ``deliver`` hands the batch to its
        asyncio loop in one thread-safe call)."""
        super().__init__("decode-engine", config.log_interval_s)
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.receiver = receiver
        self.ranks = MirroredOps(DecodeRank(receiver), engine.tp_leader)
        self.descriptor = descriptor if descriptor is not None else receiver.descriptor.to_bytes()
        self.send_destination = send_destination   # schedules Prefill.SetDestination off-thread
        self.jobs: dict[str, DecodeJob] = {}
        self._stages: dict[DecodeState, dict[str, DecodeJob]] = {state: {} for state in DecodeState}
        self._gen_tokens_logged = 0
        self._last_log_s = time.monotonic()
        self._retractions_seen = 0
        self._prompt_tokens_seen = 0               # computed here: local prefills and recomputed retractions
        self._outbox: EventBatch = []              # stream events not yet delivered (engine thread)
        self.deliver = deliver
        metrics.kv_blocks_total.set(engine.stats().kv_blocks_total)
        metrics.read_receiver(receiver.stats)

    # -- the life cycle: the one place a request's stage changes ------------------------------
    @property
    def prealloc(self) -> dict[str, DecodeJob]:
        """Waiting for blocks, in arrival order."""
        return self._stages[DecodeState.PREALLOCATING]

    @property
    def transferring(self) -> dict[str, DecodeJob]:
        return self._stages[DecodeState.TRANSFERRING]

    @property
    def releasing(self) -> dict[str, DecodeJob]:
        return self._stages[DecodeState.RELEASING]

    def _move(self, job: DecodeJob, state: DecodeState | None) -> None:
        """Put ``job`` in ``state`` (None: it is gone from this worker)."""
        if job.request_id in self.jobs:
            del self._stages[job.state][job.request_id]
        if state is None:
            self.jobs.pop(job.request_id, None)
            return
        job.state = state
        self.jobs[job.request_id] = job
        self._stages[state][job.request_id] = job

    def _live(self, request_id: str) -> DecodeJob | None:
        """The request's job unless it is gone or only RELEASING (its stream has ended)."""
        job = self.jobs.get(request_id)
        return None if job is None or job.state == DecodeState.RELEASING else job

    # -- commands (engine thread) ----------------------------------------------------------
    def add(self, job: DecodeJob) -> None:
        known = self.jobs.get(job.request_id)
        if known is not None and known.state == DecodeState.RELEASING:  # the receiver still tracks its transfer
            raise KeyError(f"request_id={job.request_id!r} is still being cleaned up here; use a new one")
        if known is not None:
            raise KeyError(f"request_id={job.request_id!r} is already running here")
        if not job.prefill_address:
            job.num_cached_tokens = self.engine.num_cached_prefix_tokens(job.prompt_token_ids, job.params.cache_salt)
            self.engine.add_request(job.request_id, job.prompt_token_ids, job.params)
            self.metrics.local_prefills.inc()
            self._move(job, DecodeState.PREFILLING)
            return
        self._move(job, DecodeState.PREALLOCATING)

    def abort(self, request_id: str, event: StreamEvent | None = None) -> bool:
        """Stop a request at any stage and free its blocks (at once, or for a transfer in
        flight as soon as no writer can touch them); its stream gets ``event``."""
        job = self._live(request_id)
        if job is None:
            return False
        if job.state == DecodeState.TRANSFERRING:
            self.ranks.run([Cancel(request_id, "aborted at the decode worker")])
            self._move(job, DecodeState.RELEASING)
        else:
            if job.state in (DecodeState.PREFILLING, DecodeState.RUNNING):
                self.engine.abort_request(request_id)
            self._move(job, None)
        event = event or StreamEvent(finish_reason="abort", num_prompt_tokens=len(job.prompt_token_ids),
                                     num_output_tokens=job.num_output_tokens)
        self._outbox.append((job.sink, event))
        return True

    def set_prefill(self, request_id: str, prefill_address: str) -> bool:
        """Point a request that still waits for its KV at another prefill worker (the first one
        died); the reservation stays, the old writer is fenced. False when the request is
        unknown, already decoding or its transfer already ended."""
        job = self._live(request_id)
        if job is None or job.state in (DecodeState.RUNNING, DecodeState.PREFILLING):
            return False
        if job.state == DecodeState.TRANSFERRING:
            # The old prefill worker may only look dead: fence it before the new one gets the
            # blocks, so a late write or notify of its own can neither count as the new one's
            # nor complete, renew or cancel the transfer.
            try:
                self.ranks.run([Fence(request_id, f"moved to prefill worker {prefill_address}")])
            except ValueError:
                return False   # the transfer just ended (done or failed): the next poll settles it
        job.prefill_address = prefill_address
        if job.state == DecodeState.TRANSFERRING:
            self.send_destination(job, self.descriptor)
        return True

    def fail(self, request_id: str, reason: str) -> None:
        """End a request with an error (e.g. its prefill worker refused the destination)."""
        if self.abort(request_id, StreamEvent(error=reason)):
            logger.warning("request failed request_id=%s: %s", request_id, reason)

    # -- the loop ------------------------------------------------------------------------
    def run_once(self) -> bool:
        try:
            self.engine.check_parallel()
            self._admit()
            self._poll_transfers()
            # Before the step: aborts from the commands just run, failed transfers, first tokens.
            self._flush_events()
            busy = self.engine.has_unfinished()
            if busy:
                outputs = self.engine.step()
                now = time.monotonic()
                if self.engine.last_step is not None:   # else it scheduled nothing
                    self.metrics.observe_step(*self.engine.last_step)
                for out in outputs:
                    self._emit(out, now)
        finally:
            self._flush_events()   # the step's tokens, every running request's, in one batch
        self._update_gauges()
        return busy

    def idle_wait_s(self) -> float:
        return 0.002 if self.transferring or self.releasing else 0.05

    def _admit(self) -> None:
        block_size = self.engine.block_size
        pending_future = sum(j.params.max_tokens for j in self.transferring.values())
        admitted: list[DecodeJob] = []
        for job in list(self.prealloc.values()):
            # Room for the prompt and the first token (unless the prompt already fills
            # max_model_len: then the first token ends the request and is never cached).
            num_tokens = min(len(job.prompt_token_ids) + 1, self.engine.max_model_len)
            block_ids = self.engine.reserve_blocks(num_tokens, pending_future + job.params.max_tokens,
                                                   transfers_pending=bool(self.transferring))
            if block_ids is None:
                break  # wait for room
            job.block_ids = block_ids
            # The first token's K/V is computed here, so only the prompt's blocks are written.
            job.transfer_block_ids = job.block_ids[:cdiv(len(job.prompt_token_ids), block_size)]
            job.reserved_s = time.monotonic()
            self._move(job, DecodeState.TRANSFERRING)
            pending_future += job.params.max_tokens
            admitted.append(job)
        if not admitted:
            return
        # Every rank expects the writes before any prefill rank can learn where to write (the
        # reply is the followers' acknowledgement).
        num_layers = self.engine.arch.num_layers
        self.ranks.run([Expect(j.request_id, j.transfer_block_ids, num_layers, self.config.kv_lease_s)
                        for j in admitted], reply=True)
        for job in admitted:
            self.send_destination(job, self.descriptor)

    def _poll_transfers(self) -> None:
        jobs = [*self.transferring.values(), *self.releasing.values()]
        if not jobs:
            return
        codes = self.ranks.run([Poll([job.request_id for job in jobs])], reply=True)  # min over ranks
        for i, job in enumerate(jobs):
            request_id = job.request_id
            code, all_freeable = codes[i * POLL_FIELDS:(i + 1) * POLL_FIELDS]
            poll = ReceivePoll(code)
            if job.state == DecodeState.RELEASING:   # free once no rank's writer can touch the blocks
                if all_freeable:
                    self.ranks.run([Release(request_id)])
                    self.engine.free_blocks(job.block_ids)
                    self._move(job, None)
            elif poll is ReceivePoll.DONE:
                payload = self.receiver.result(request_id).payload   # rank 0's notify
                # Done means the notify came, after _admit reserved the blocks.
                assert payload is not None and job.reserved_s is not None
                self.ranks.run([Release(request_id)])
                self.metrics.kv_transfer_seconds.observe(time.monotonic() - job.reserved_s)
                problem = self._check_payload(payload)
                if problem is None:
                    self._start_decoding(job, payload)
                else:   # the KV landed, but nothing may be decoded from it: fail this request only
                    self._move(job, None)
                    self.engine.free_blocks(job.block_ids)
                    logger.warning("bad notify from the prefill worker request_id=%s: %s", request_id, problem)
                    self._outbox.append((job.sink, StreamEvent(error=f"the prefill worker sent {problem}")))
            elif poll is ReceivePoll.FAILED:
                # Failed on some rank: stop the others too; the blocks go once all are freeable.
                result = self.receiver.result(request_id)
                reason = result.reason if result.status.terminal else "KV transfer failed on another TP rank"
                self.ranks.run([Cancel(request_id, reason)])
                self._move(job, DecodeState.RELEASING)
                self.metrics.kv_transfer_failures.inc()
                logger.warning("KV transfer failed request_id=%s: %s", request_id, reason)
                error = StreamEvent(error=f"KV transfer from the prefill worker failed: {reason}", transient=True)
                self._outbox.append((job.sink, error))

    def _check_payload(self, payload: kvtransfer.NotifyPayload) -> str | None:
        """What is wrong with a prefill worker's notify (its token ids index the embedding and
        the vocabulary of every later step), or None."""
        vocab = self.engine.arch.vocab_size
        if not 0 <= payload.first_token_id < vocab:
            return f"first token id {payload.first_token_id}, outside the vocabulary [0, {vocab})"
        bad = next((t for t, _ in payload.top_logprobs if not 0 <= t < vocab), None)
        if bad is not None:
            return f"top logprob token id {bad}, outside the vocabulary [0, {vocab})"
        return None

    def _start_decoding(self, job: DecodeJob, payload: kvtransfer.NotifyPayload) -> None:
        first_logprobs = None
        if job.params.logprobs is not None and payload.first_logprob is not None:
            first_logprobs = {payload.first_token_id: payload.first_logprob}
            first_logprobs.update(dict(payload.top_logprobs))
        try:
            first = self.engine.add_prefilled(job.request_id, job.prompt_token_ids, job.params, job.block_ids,
                                              payload.first_token_id, first_logprobs)
        except ValueError as exc:   # the first token does not follow the request's grammar
            self._move(job, None)
            self.engine.free_blocks(job.block_ids)
            logger.warning("cannot start decoding request_id=%s: %s", job.request_id, exc)
            self._outbox.append((job.sink, StreamEvent(error=f"the prefill worker's first token: {exc}")))
            return
        job.num_cached_tokens = payload.num_cached_tokens
        self._emit(first, time.monotonic())

    def _emit(self, out: StepOutput, now: float) -> None:
        job = self._live(out.request_id)
        if job is None:
            return
        job.num_output_tokens += len(out.new_token_ids)
        if job.last_token_s is None:   # its first token: after its KV landed, or its local prefill
            self.metrics.ttft.observe(now - job.arrival_s)
            self._move(job, DecodeState.RUNNING)
        else:
            self.metrics.itl.observe(now - job.last_token_s)
        job.last_token_s = now
        event = StreamEvent(out.new_token_ids, out.new_logprobs)
        if out.finished:
            self._move(job, None)
            event.finish_reason = out.finish_reason
            event.num_prompt_tokens = len(job.prompt_token_ids)
            event.num_output_tokens = job.num_output_tokens
            event.num_cached_tokens = job.num_cached_tokens
        self._outbox.append((job.sink, event))

    def _flush_events(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self.deliver(batch)

    # -- observability -------------------------------------------------------------------------
    def _update_gauges(self) -> None:
        stats = self.engine.stats()
        self.metrics.running.set(stats.num_running)
        self.metrics.waiting.set(stats.num_waiting)
        self.metrics.preallocated.set(len(self.prealloc))
        self.metrics.transferring.set(len(self.transferring))
        self.metrics.kv_usage.set(stats.kv_usage)
        if stats.num_prompt_tokens > self._prompt_tokens_seen:
            self.metrics.prompt_tokens.inc(stats.num_prompt_tokens - self._prompt_tokens_seen)
            self._prompt_tokens_seen = stats.num_prompt_tokens
        if stats.num_retractions > self._retractions_seen:
            self.metrics.retractions.inc(stats.num_retractions - self._retractions_seen)
            self._retractions_seen = stats.num_retractions

    def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        return {"role": "decode", "num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "num_preallocated": len(self.prealloc), "num_transferring": len(self.transferring),
                "kv_blocks_used": stats.kv_blocks_used, "kv_blocks_total": stats.kv_blocks_total,
                "gen_tokens_per_s": self._gen_rate(time.monotonic(), stats.num_generated_tokens),
                "prefix_cache_queries": stats.num_prefix_queried_tokens,
                "prefix_cache_hits": stats.num_prefix_hit_tokens, "num_retractions": stats.num_retractions,
                "model": self.engine.model_name, "max_model_len": self.engine.max_model_len}

    def _gen_rate(self, now: float, num_generated_tokens: int) -> float:
        elapsed = max(now - self._last_log_s, 1e-6)
        return (num_generated_tokens - self._gen_tokens_logged) / elapsed

    def log_stats(self, now: float) -> None:
        stats = self.engine.stats()
        generated = stats.num_generated_tokens - self._gen_tokens_logged
        if generated:
            self.metrics.generation_tokens.inc(generated)
        if stats.num_running or generated:
            logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                        "gen throughput (token/s): %.2f, #queue-req: %d", stats.num_running,
                        stats.num_running_tokens, stats.kv_usage, self._gen_rate(now, stats.num_generated_tokens),
                        len(self.prealloc) + stats.num_waiting)
        self._gen_tokens_logged = stats.num_generated_tokens
        self._last_log_s = now
