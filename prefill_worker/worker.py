"""The prefill role's engine thread: compute prompts, push their KV layer by layer, notify.

Runs on the prefill worker's engine thread. A job is submitted by the router; its destination
(the decode worker's reserved block ids and region descriptor) arrives separately from the
decode worker, before or after the prompt is computed. As soon as both are known, each layer's
K/V of the prompt is written into the decode worker's pool right after that layer runs
(layer-pipelined); then the first token is sampled and sent with ``notify``. The job's blocks
stay referenced until every transfer op has finished, then return to the prefix cache.

Under tensor parallelism this is rank 0: each rank ships its own KV heads to the decode
worker's rank of the same number (prefill_worker/ranks.py); this loop decides, every rank
acts, and a job's blocks return only once every rank's transfer ops have finished.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kvtransfer
from engine.config import SamplingParams
from engine.llm_engine import LLMEngine, PromptChunk, StepOutput
from engine.math_utils import cdiv
from prefill_worker.ops import Cancel, CancelAt, Forget, Notify, Open, Poll, SendPoll, Write
from prefill_worker.ranks import PrefillRank
from worker.config import WorkerConfig
from worker.loop import EngineLoop
from worker.metrics import WorkerMetrics
from worker.tp_role import MirroredOp, MirroredOps

logger = logging.getLogger(__name__)

EARLY_DESTINATION_TTL_S = 60.0  # a destination may arrive before its Submit; kept this long


class AbortedBeforeSubmit(Exception):
    """A Submit for a request id that was aborted (or whose destination was refused) before it came."""


@dataclass
class Destination:
    block_ids: list[int]
    descriptor: bytes


class PrefillStage(enum.Enum):
    """Where a prompt is on this worker (``PrefillJob.stage``; ``PrefillLoop`` opens with the life
    cycle). Only ``PrefillLoop._move`` changes it."""

    COMPUTING = "computing"   # the engine computes the prompt; none of its KV written yet
    WRITING = "writing"       # computing, and each chunk's KV is written layer by layer as it runs
    COMPUTED = "computed"     # computed (``first``), its blocks held, waiting for its destination
    SHIPPED = "shipped"       # every write and the notify are out: ``_reap`` polls them

    @property
    def transferring(self) -> bool:
        """Transfer ops are out (on every rank)."""
        return self in (PrefillStage.WRITING, PrefillStage.SHIPPED)


@dataclass
class PrefillJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    decode_address: str
    arrival_s: float = field(default_factory=time.monotonic)
    stage: PrefillStage = PrefillStage.COMPUTING
    destination: Destination | None = None    # the decode worker's blocks, whenever they come
    first: StepOutput | None = None           # the first token, once the prompt is computed
    layers_shipped: bool = False              # every block's per-layer writes issued during forwards
    next_block: int = 0                       # blocks before this one were written whole, every layer
    destination_s: float | None = None


class PrefillLoop(EngineLoop):
    """A prompt's life here, one ``PrefillJob.stage`` (``_move`` is the only writer):

        COMPUTING --_layer_plan (destination known)--> WRITING --last chunk: _ship--> SHIPPED
        COMPUTING --last chunk, no destination yet--> COMPUTED --set_destination: _ship--> SHIPPED
        SHIPPED --_reap: every rank's transfer ops done--> (gone: its blocks go back to the prefix cache)

    Its destination (``set_destination``, from the decode worker) may come at any point. While
    WRITING, each chunk's blocks are written after every layer of its forward (``_layer_plan``;
    ``next_block`` and ``layers_shipped`` count how far); ``_ship`` writes what is left and sends
    the notify. Any stage ends at once on an abort; COMPUTED ends after
    ``EARLY_DESTINATION_TTL_S`` without a destination. ``jobs`` holds every submitted prompt until
    it is gone (kept by ``_move`` too). Before its Submit a request has no job: a destination that
    comes first waits in ``early``, an Abort that comes first is remembered in ``ended`` (and the
    Submit is refused)."""

    def __init__(self, engine: LLMEngine, config: WorkerConfig, metrics: WorkerMetrics,
                 fabric: kvtransfer.FakeFabric | None = None) -> None:
        super().__init__("prefill-engine", config.log_interval_s)
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.fabric = fabric
        self.rank = PrefillRank(engine.kv_pool.tensor, 0, engine.parallel.tensor_parallel_size,
                                config.kv_backend, fabric, stall_s=config.kv_lease_s,
                                secret=config.cluster_secret or None)
        self.ranks = MirroredOps(self.rank, engine.tp_leader)
        self.layout = self.rank.layout
        self.tp_size = self.rank.tp_size
        self.jobs: dict[str, PrefillJob] = {}
        self.early: dict[str, tuple[Destination, float]] = {}
        self.ended: dict[str, float] = {}          # aborted before their Submit came: its Submit is refused
        self._write_layer: Callable[[int], None] | None = None   # this step's per-layer writes (_layer_plan)
        self._interval = {"new_seq": 0, "new_token": 0, "cached_token": 0}
        self._last_prompt_tokens = 0
        self._last_prefix = (0, 0)                # engine's (queried, hit) prefix tokens at the last update
        self._rate_mark = (time.monotonic(), 0)   # (time, prompt tokens) at the last log line
        metrics.kv_blocks_total.set(engine.stats().kv_blocks_total)

    # -- commands (engine thread) ----------------------------------------------------------
    def submit(self, job: PrefillJob) -> int:
        """Queue a prompt; returns the prompt tokens found in the prefix cache."""
        if job.request_id in self.jobs:
            raise KeyError(f"request_id={job.request_id!r} is already submitted")
        if self.ended.pop(job.request_id, None) is not None:
            raise AbortedBeforeSubmit(f"request_id={job.request_id!r} was aborted before its Submit arrived")
        # The prefill worker samples only the first token.
        self.engine.add_request(job.request_id, job.prompt_token_ids,
                                dataclasses.replace(job.params, max_tokens=1))
        self._move(job, PrefillStage.COMPUTING)
        self._interval["new_seq"] += 1
        early = self.early.pop(job.request_id, None)
        if early is not None:
            try:
                self.set_destination(job.request_id, early[0])
            except ValueError:
                self.abort(job.request_id)  # the Submit is refused: leave nothing computing
                raise
        return self.engine.num_cached_prefix_tokens(job.prompt_token_ids, job.params.cache_salt)

    def set_destination(self, request_id: str, destination: Destination) -> None:
        job = self.jobs.get(request_id)
        if job is None:
            if request_id in self.ended:
                # Its Abort overtook it (two separate RPCs): nothing will be written, so the
                # decode worker frees the blocks now, not when their lease runs out.
                self._cancel_early(request_id, destination)
                return
            self.early[request_id] = (destination, time.monotonic())
            return
        if job.destination is not None:
            raise ValueError(f"request_id={request_id!r} already has a destination")
        num_blocks = cdiv(len(job.prompt_token_ids), self.engine.block_size)
        if len(destination.block_ids) != num_blocks:
            raise ValueError(f"request_id={request_id!r}: {len(destination.block_ids)} destination blocks "
                             f"for a prompt that fills {num_blocks}")
        if len(set(destination.block_ids)) != num_blocks:
            raise ValueError(f"request_id={request_id!r}: the destination block ids hold a duplicate")
        # ValueError: refused (a bad descriptor, a layout mismatch, block ids outside the pool).
        self.ranks.run([Open(request_id, destination.descriptor, destination.block_ids)])
        job.destination = destination
        job.destination_s = time.monotonic()
        if job.stage == PrefillStage.COMPUTED:
            self._ship(job)

    def _move(self, job: PrefillJob, stage: PrefillStage | None) -> None:
        """Put ``job`` in ``stage`` (None: it is gone from this worker)."""
        if stage is None:
            self.jobs.pop(job.request_id, None)
            return
        job.stage = stage
        self.jobs[job.request_id] = job

    def abort(self, request_id: str) -> bool:
        job = self.jobs.get(request_id)
        if job is None:
            early = self.early.pop(request_id, None)
            if early is not None:
                self._cancel_early(request_id, early[0])
            else:
                # An Abort (or a refused destination) can overtake its Submit: remember it, or
                # the Submit would compute a prompt nobody reads and hold its blocks.
                self.ended[request_id] = time.monotonic()
            return early is not None
        self._move(job, None)
        if job.destination is not None:
            self.ranks.run([Cancel(request_id, "aborted at the prefill worker"), Forget(request_id)])
        # Source blocks are only read by in-flight writes, and the request is cancelled, so
        # they can go back to the pool now.
        self.engine.abort_request(request_id)
        return True

    def _cancel_early(self, request_id: str, destination: Destination) -> None:
        """Tell the decode worker nothing will be written into a destination that came before
        its Submit, so it frees the reserved blocks now, not when their lease runs out."""
        try:
            self.ranks.run([CancelAt(destination.descriptor, request_id, "aborted at the prefill worker")])
        except ValueError as exc:  # a destination we could never have written to
            logger.warning("cannot cancel request_id=%s at its decode worker: %s", request_id, exc)

    # -- the loop ------------------------------------------------------------------------
    def run_once(self) -> bool:
        self.engine.check_parallel()
        busy = self.engine.has_unfinished()
        outputs: list[StepOutput] = []
        if busy:
            outputs = self.engine.step(self._after_layer, self._layer_plan)
            if self.engine.last_step is not None:   # else it scheduled nothing
                self.metrics.observe_step(*self.engine.last_step)
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            job.first = out
            self.metrics.ttft.observe(time.monotonic() - job.arrival_s)
            if job.destination is not None:
                self._ship(job)
            else:
                self._move(job, PrefillStage.COMPUTED)
        self._reap()
        self._expire_early()
        self._update_gauges()
        return busy

    def idle_wait_s(self) -> float:
        return 0.002 if any(j.stage.transferring for j in self.jobs.values()) else 0.05

    def _layer_plan(self, chunks: list[PromptChunk]) -> dict[str, Any]:
        """Before a step: the prompts whose KV is written layer by layer during its forward
        (sent to the followers with the step, so each rank writes its own heads).

        Every chunk of a prompt with a destination writes, after each layer, the blocks it
        fills and the blocks before them not written yet (all of them, cached prefix included,
        for the first chunk after the destination came), so the transfer of a long prompt runs
        beside all of its chunks, not only the last. A block the chunk fills only in part goes
        again with the next chunk; writes are in order per sender, and the decode worker takes
        the KV only at the notify, which follows them all."""
        writes: list[list[Any]] = []
        block_size = self.engine.block_size
        for chunk in chunks:
            job = self.jobs.get(chunk.request_id)
            if job is None or job.destination is None:
                continue  # nowhere to send it yet: _ship writes every layer once it is known
            src, dst = self._block_pairs(job, chunk.block_ids)
            upto = cdiv(chunk.end, block_size)
            writes.append([job.request_id, src[job.next_block:upto], dst[job.next_block:upto]])
            job.next_block = chunk.end // block_size
            self._move(job, PrefillStage.WRITING)
            job.layers_shipped = chunk.completes_prompt
        plan = {"writes": writes}
        # Rank 0 writes its heads with the hook every follower rank builds from the same plan.
        self._write_layer = self.rank.after_layer(plan)
        return plan

    def _after_layer(self, layer: int) -> None:
        if self._write_layer is not None:
            self._write_layer(layer)

    def _ship(self, job: PrefillJob) -> None:
        """Write what the forward pass did not ship yet, then send the first token."""
        held = self.engine.held_request(job.request_id)  # finished here, blocks kept for the transfer
        if held is None:
            return
        ops: list[MirroredOp] = []
        if not job.layers_shipped:
            src, dst = self._block_pairs(job, held.block_ids)
            ops.append(Write(job.request_id, list(range(self.layout.num_layers)), src, dst))
            job.layers_shipped = True
        first = job.first
        assert first is not None   # shipped only once the prompt is computed
        token = first.new_token_ids[0]
        entry = first.new_logprobs[0] if first.new_logprobs else None
        # entry holds the sampled token and the top k; sorted, its first k are the top k.
        top = tuple(sorted(entry.items(), key=lambda kv: -kv[1])[:job.params.logprobs or 0]) if entry else ()
        payload = kvtransfer.NotifyPayload(
            first_token_id=token, first_logprob=None if entry is None else entry[token], top_logprobs=top,
            num_prompt_tokens=len(job.prompt_token_ids), num_cached_tokens=held.num_prefix_hit_tokens)
        ops.append(Notify(job.request_id, payload))
        self.ranks.run(ops)
        self._move(job, PrefillStage.SHIPPED)

    def _block_pairs(self, job: PrefillJob, src_block_ids: list[int]) -> tuple[list[int], list[int]]:
        num_blocks = cdiv(len(job.prompt_token_ids), self.engine.block_size)
        assert job.destination is not None   # only a job with a destination is written
        return src_block_ids[:num_blocks], job.destination.block_ids[:num_blocks]

    def _reap(self) -> None:
        """Release the blocks of jobs whose transfer ops all finished (or whose destination
        never came: the decode worker is gone)."""
        now = time.monotonic()
        for request_id, job in list(self.jobs.items()):
            if job.stage == PrefillStage.COMPUTED and now - job.arrival_s > EARLY_DESTINATION_TTL_S:
                logger.warning("no destination within %.0f s, dropping request_id=%s", EARLY_DESTINATION_TTL_S,
                               request_id)
                self.abort(request_id)
        shipped = [r for r, j in self.jobs.items() if j.stage == PrefillStage.SHIPPED]
        if not shipped:
            return
        codes = self.ranks.run([Poll(shipped)], reply=True)   # min over ranks: one SendPoll each
        finished: list[MirroredOp] = []
        for request_id, code in zip(shipped, codes, strict=True):
            poll = SendPoll(code)
            if poll is SendPoll.IN_FLIGHT:
                continue
            job = self.jobs[request_id]
            self._move(job, None)
            if poll is SendPoll.FAILED:
                self.metrics.kv_transfer_failures.inc()
                logger.warning("KV transfer failed request_id=%s: %s", request_id,
                               self.rank.error(request_id) or "failed on another TP rank")
            else:
                assert job.destination is not None and job.destination_s is not None   # it was shipped
                self.metrics.kv_transfer_seconds.observe(time.monotonic() - job.destination_s)
                self.metrics.kv_transfer_bytes.inc(self.layout.geometry.bytes_per_block * self.tp_size
                                                   * len(self._block_pairs(job, job.destination.block_ids)[0]))
            self.engine.release(request_id)
            finished.append(Forget(request_id))
        if finished:
            self.ranks.run(finished)

    def _expire_early(self) -> None:
        now = time.monotonic()
        for request_id, (_, at) in list(self.early.items()):
            if now - at > EARLY_DESTINATION_TTL_S:
                del self.early[request_id]
        for request_id, at in list(self.ended.items()):
            if now - at > EARLY_DESTINATION_TTL_S:
                del self.ended[request_id]

    # -- observability -------------------------------------------------------------------------
    def _update_gauges(self) -> None:
        stats = self.engine.stats()
        self.metrics.running.set(stats.num_running)
        self.metrics.waiting.set(stats.num_waiting)
        self.metrics.transferring.set(sum(1 for j in self.jobs.values() if j.stage.transferring))
        self.metrics.kv_usage.set(stats.kv_usage)
        new_tokens = stats.num_prompt_tokens - self._last_prompt_tokens
        if new_tokens:
            self.metrics.prompt_tokens.inc(new_tokens)
            self._interval["new_token"] += new_tokens
            self._last_prompt_tokens = stats.num_prompt_tokens
        # The engine keeps running totals; the counters take the difference since last time.
        self.metrics.prefix_queries.inc(stats.num_prefix_queried_tokens - self._last_prefix[0])
        self.metrics.prefix_hits.inc(stats.num_prefix_hit_tokens - self._last_prefix[1])
        self._last_prefix = (stats.num_prefix_queried_tokens, stats.num_prefix_hit_tokens)

    def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        return {"role": "prefill", "num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "num_preallocated": 0, "num_transferring": sum(1 for j in self.jobs.values() if j.stage.transferring),
                "kv_blocks_used": stats.kv_blocks_used, "kv_blocks_total": stats.kv_blocks_total,
                "prompt_tokens_per_s": self._prompt_rate(time.monotonic(), stats.num_prompt_tokens),
                "prefix_cache_queries": stats.num_prefix_queried_tokens,
                "prefix_cache_hits": stats.num_prefix_hit_tokens, "num_retractions": 0,
                "model": self.engine.model_name, "max_model_len": self.engine.max_model_len}

    def _prompt_rate(self, now: float, num_prompt_tokens: int) -> float:
        at, tokens = self._rate_mark
        return (num_prompt_tokens - tokens) / max(now - at, 1e-6)

    def log_stats(self, now: float) -> None:
        stats = self.engine.stats()
        counts = self._interval
        if counts["new_seq"] or counts["new_token"]:
            logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                        "#queue-req: %d", counts["new_seq"], counts["new_token"],
                        stats.num_prefix_hit_tokens - counts["cached_token"], stats.kv_usage, stats.num_waiting)
        self._interval = {"new_seq": 0, "new_token": 0, "cached_token": stats.num_prefix_hit_tokens}
        self._rate_mark = (now, stats.num_prompt_tokens)

    def close(self) -> None:
        self.rank.close()
