"""The colocated engine loop: schedule, run, postprocess — prefill and decode in one process.

Runs on whichever thread calls ``step()`` (the `LLM` API's caller, or a worker's engine thread).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.block_manager import BlockAllocator
from engine.config import CacheConfig, ModelConfig, ParallelConfig, SamplingParams, SchedulerConfig, StructuredOutput
from engine.kv_cache import KVPool
from engine.math_utils import cdiv
from engine.model_runner import ModelRunner
from engine.model_source import ModelSource
from engine.models.arch import ArchConfig
from engine.sampler import Sampler, SamplerOutput, SamplingRequest, advance_generator, make_generator
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.sim.runner import SimRunner
from engine.sim.sampler import SimSampler
from engine.structured import GrammarCache
from engine.tokenizer import Tokenizer
from engine.tp.group import Leader, TPGroup

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None


@dataclass(frozen=True)
class PromptChunk:
    """A piece of a prompt one step computes, as a worker role sees it (``step``'s ``step_extra``):
    tokens ``start`` to ``end`` of the request, whose KV lands in ``block_ids`` (read only)."""

    request_id: str
    block_ids: list[int]              # the request's blocks so far, the chunk's last one included
    start: int                        # tokens computed before this chunk
    end: int                          # tokens computed once it runs
    completes_prompt: bool            # the prompt's last chunk: the step samples its first token


@dataclass(frozen=True)
class HeldRequest:
    """A finished request whose blocks ``keep_finished_blocks`` kept until ``release`` (a prefill
    worker's prompt, while its KV is written to the decode worker)."""

    block_ids: list[int]
    num_prefix_hit_tokens: int        # prompt tokens that were served from the prefix cache


@dataclass(frozen=True)
class EngineStats:
    """The engine's load and capacity at one moment; a worker's logs, metrics and Stats RPC all
    read it. The ``num_*_tokens`` and ``num_retractions`` are running totals since start."""

    num_running: int
    num_waiting: int
    num_running_tokens: int           # prompt + output tokens of the running requests
    kv_blocks_used: int
    kv_blocks_total: int
    num_prefix_queried_tokens: int    # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int        # of those, found there
    num_retractions: int
    num_prompt_tokens: int            # computed by prefill chunks
    num_generated_tokens: int

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks referenced by at least one request, in [0, 1]."""
        return self.kv_blocks_used / self.kv_blocks_total


class LLMEngine:
    """Schedule, run, postprocess. ``keep_finished_blocks``: a finished request's blocks stay
    referenced until ``release`` (a prefill worker ships them after the request ends).

    With ``parallel_config.tensor_parallel_size > 1`` this is rank 0: it joins the TP group
    (whose followers must be started separately) and its runner broadcasts every step."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, keep_finished_blocks: bool = False,
                 parallel_config: ParallelConfig = ParallelConfig()) -> None:
        if not parallel_config.is_leader:
            raise ValueError(f"tp_rank={parallel_config.tp_rank}: an LLMEngine is rank 0; ranks > 0 run "
                             "engine.tp.follower")
        self.runner: ModelRunner | SimRunner
        self.sampler: Sampler | SimSampler
        if model_config.engine == "sim":
            # Everything but the forward pass is the real engine's (engine/sim/__init__.py).
            self.runner = SimRunner(model_config, cache_config, scheduler_config.chunked_prefill_size,
                                    parallel_config)
            self.sampler = SimSampler(self.runner.arch.vocab_size)
        else:
            self.runner = ModelRunner(model_config, cache_config, scheduler_config.chunked_prefill_size,
                                      parallel_config)
            self.sampler = Sampler()
            if self.on_cpu:
                Sampler.build_native()   # compile now, not inside the first sampled step
        try:
            self.tokenizer = Tokenizer.from_model(str(self.runner.source.path))
        except BaseException:
            self.runner.close()  # do not leave the /dev/shm pool behind
            raise
        self.max_model_len = self.runner.max_model_len
        self.model_name = model_config.model
        self.dummy_weights = model_config.load_format == "dummy"   # random weights: see fingerprint
        self.allocator = BlockAllocator(self.runner.num_blocks, cache_config.block_size,
                                        cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(replace(scheduler_config, chunked_prefill_size=self.runner.max_num_batched_tokens),
                                   self.allocator, self.max_model_len)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | set(self.runner.arch.eos_token_ids)
        # Structured output: the grammar's end is an end-of-sequence token (engine/structured.py).
        self.grammars = GrammarCache(self.tokenizer, self.runner.arch.vocab_size, self.eos_token_ids)
        self.sequences: dict[str, Sequence] = {}
        self.keep_finished_blocks = keep_finished_blocks
        self.held: dict[str, Sequence] = {}   # finished, blocks not yet released
        self.num_prompt_tokens_total = 0      # tokens computed by prefill chunks
        self.num_generated_tokens_total = 0
        # (ScheduledBatch.kind, wall seconds) of the last step; None when it scheduled nothing
        self.last_step: tuple[str, float] | None = None

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.sequences:
            raise ValueError(f"request_id={request_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, longer than "
                             f"max_model_len={self.max_model_len}")
        vocab = self.runner.arch.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        grammar = self._grammar(params, prompt_token_ids)
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_s=time.monotonic(),
                       generator=self._generator(params, 0), grammar=grammar)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      block_ids: list[int], first_token: int,
                      first_logprobs: dict[int, float] | None = None) -> StepOutput:
        """Start decoding a request whose prompt KV already sits in ``block_ids`` (written by a
        prefill worker) and whose first token was sampled there. Returns that token as the
        request's first output: finished already when it ends the request (eos, a stop token,
        ``max_tokens`` of 1), and then the request is not running."""
        if request_id in self.sequences:
            raise ValueError(f"request_id={request_id!r} is already running")
        grammar = self._grammar(params, prompt_token_ids, first_token)
        # The prefill worker drew the first token from this seed: skip that draw so the rest of
        # the stream matches a colocated run.
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_s=time.monotonic(),
                       generator=self._generator(params, 1), grammar=grammar)
        seq.block_ids = list(block_ids)
        seq.num_computed_tokens = len(prompt_token_ids)
        seq.output_token_ids.append(first_token)
        self.num_generated_tokens_total += 1  # sampled elsewhere, streamed from here
        if params.logprobs is not None and first_logprobs is not None:
            seq.logprobs.append(first_logprobs)
        self.scheduler.cache_computed_blocks(seq)
        self.sequences[request_id] = seq
        reason = self._finish_reason(seq, first_token)
        if reason is not None:
            self.sequences.pop(request_id)
            seq.finish(reason)
            self.scheduler.release(seq)
        else:
            self.scheduler.add_running(seq)
        return StepOutput(request_id, [first_token], list(seq.logprobs), finished=seq.is_finished,
                          finish_reason=seq.finish_reason)

    def _generator(self, params: SamplingParams, num_drawn_elsewhere: int):
        """A seeded request's generator, past the draws of the tokens sampled before it gets here:
        the output of an earlier attempt (``num_resumed_tokens``) and ``num_drawn_elsewhere``."""
        generator = make_generator(params.seed, self.runner.device)
        if generator is not None and not params.greedy:
            for _ in range(params.num_resumed_tokens + num_drawn_elsewhere):
                advance_generator(generator, self.runner.arch.vocab_size)
        return generator

    def _grammar(self, params: SamplingParams, prompt_token_ids: list[int], *sampled: int):
        """The request's grammar matcher (None when unconstrained), resumed past the output an
        earlier attempt generated (the prompt's tail) and ``sampled``; ValueError when the
        constraint does not compile or those tokens do not follow it."""
        num_resumed = params.num_resumed_tokens
        if num_resumed > len(prompt_token_ids):
            raise ValueError(f"num_resumed_tokens={num_resumed} is more than the prompt's "
                             f"{len(prompt_token_ids)} tokens")
        constraint = params.structured
        if constraint is None:
            return None
        resumed = list(prompt_token_ids[len(prompt_token_ids) - num_resumed:]) if num_resumed else []
        return self.grammars.matcher(constraint, resumed + list(sampled))

    def compile_grammar(self, constraint: StructuredOutput) -> None:
        """Compile ``constraint`` ahead of its request, so that adding the request does not wait
        on it; ValueError naming the problem. Thread-safe: servicers call it off the engine thread."""
        self.grammars.compile(constraint)

    def abort_request(self, request_id: str) -> bool:
        if request_id in self.held:
            self.release(request_id)
            return True
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def held_request(self, request_id: str) -> HeldRequest | None:
        """What ``keep_finished_blocks`` keeps of a finished request; None once released or aborted."""
        seq = self.held.get(request_id)
        return None if seq is None else HeldRequest(seq.block_ids, seq.num_prefix_hit_tokens)

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished request kept by ``keep_finished_blocks``."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.scheduler.release(seq)

    def tune_kernels(self) -> None:
        """Time the load-time kernel choices (the GGUF block linears) now, on this thread with
        its torch threads; otherwise the first step does. Call it on the thread that steps."""
        self.runner.tune_kernels()

    def check_parallel(self) -> None:
        """Raise if a tensor-parallel follower is gone (found by the heartbeat while idle)."""
        if self.runner.leader is not None:
            self.runner.leader.check()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- what a worker role reads and reserves (its only way into the engine) -------------------
    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def arch(self) -> ArchConfig:
        return self.runner.arch

    @property
    def on_cpu(self) -> bool:
        """The model runs on CPU (a worker may bind its torch threads to cores)."""
        return self.runner.device.type == "cpu"

    @property
    def model_source(self) -> ModelSource:
        return self.runner.source

    @property
    def parallel(self) -> ParallelConfig:
        return self.runner.parallel

    @property
    def kv_pool(self) -> KVPool:
        """This rank's KV pool, which kvtransfer reads from (prefill) or registers (decode)."""
        assert self.runner.kv_pool is not None, "the KV pool is allocated in __init__"
        return self.runner.kv_pool

    @property
    def tp_group(self) -> TPGroup | None:
        return self.runner.group

    @property
    def tp_leader(self) -> Leader | None:
        """Rank 0's side of the TP group (None without TP), to mirror role ops on."""
        return self.runner.leader

    def num_cached_prefix_tokens(self, prompt_token_ids: list[int], cache_salt: str = "") -> int:
        """Prompt tokens the prefix cache holds now for this salt, in whole blocks (a look: nothing is taken)."""
        return self.allocator.peek_prefix_blocks(prompt_token_ids, cache_salt.encode()) * self.allocator.block_size

    def reserve_blocks(self, num_tokens: int, num_future_tokens: int, transfers_pending: bool) -> list[int] | None:
        """Blocks for ``num_tokens`` tokens whose KV another process writes (a decode worker's
        prompt, from its prefill worker), or None: wait. They are taken when they fit beside the
        output room running requests are expected to need plus ``num_future_tokens`` (the
        scheduler's estimate), or, with nothing running and no other transfer pending, whenever
        they are free, so a long request is not kept out by room only it would use. Hand them to
        ``add_prefilled`` or back to ``free_blocks``."""
        num_blocks = cdiv(num_tokens, self.allocator.block_size)
        if not self.scheduler.can_reserve(num_blocks, num_future_tokens):
            if self.scheduler.running or transfers_pending:
                return None   # wait for running requests to finish
            if num_blocks > self.allocator.num_free_blocks:
                return None
        return self.allocator.allocate(num_blocks)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Give back blocks from ``reserve_blocks`` that no request adopted."""
        self.allocator.free(block_ids[::-1])   # tail first: a prompt's last blocks are evicted first

    def stats(self) -> EngineStats:
        alloc, sched = self.allocator, self.scheduler
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_running_tokens=sum(s.num_tokens for s in sched.running),
            kv_blocks_used=alloc.num_used_blocks, kv_blocks_total=alloc.num_blocks,
            num_prefix_queried_tokens=alloc.num_prefix_queries_tokens,
            num_prefix_hit_tokens=alloc.num_prefix_hit_tokens, num_retractions=sched.num_retracted_total,
            num_prompt_tokens=self.num_prompt_tokens_total, num_generated_tokens=self.num_generated_tokens_total)

    # -- one step ---------------------------------------------------------------------------
    def step(self, after_layer: Callable[[int], None] | None = None,
             step_extra: Callable[[list[PromptChunk]], dict] | None = None) -> list[StepOutput]:
        """One schedule-run-postprocess round; ``after_layer(i)`` runs once layer i's K/V is
        cached (see LlamaForCausalLM.forward); ``step_extra(chunks)``, given the prompt chunks the
        step computes, is what TP followers get with the step for their own ``after_layer``."""
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            self.last_step = None
            return []
        extra = None if step_extra is None else step_extra(_prompt_chunks(batch))
        logits = self.runner.execute(batch, after_layer, extra)
        sampling = self._sampling_seqs(batch)
        sampled = self.sampler(logits, [_sampling_request(s) for s in sampling])
        outputs = self._postprocess(batch, sampling, sampled)
        self.last_step = (batch.kind, time.perf_counter() - started)
        return outputs

    def _sampling_seqs(self, batch: ScheduledBatch) -> list[Sequence]:
        seqs = [s for s, n in batch.prefills if s.num_computed_tokens + n == s.num_tokens]
        return seqs + batch.decodes

    def _postprocess(self, batch: ScheduledBatch, sampling: list[Sequence],
                     sampled: SamplerOutput) -> list[StepOutput]:
        for seq, num_new in batch.prefills:
            seq.num_computed_tokens += num_new
            self.num_prompt_tokens_total += num_new
            self.scheduler.cache_computed_blocks(seq)
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
            self.scheduler.cache_computed_blocks(seq)
        outputs = []
        self.num_generated_tokens_total += len(sampling)
        for i, seq in enumerate(sampling):
            token = sampled.token_ids[i]
            seq.output_token_ids.append(token)
            off_grammar = seq.grammar is not None and not seq.grammar.accept(token)
            out = StepOutput(seq.request_id, [token])
            if seq.params.logprobs is not None:
                assert sampled.logprobs is not None and sampled.top_logprobs is not None   # asked for by this row
                entry = {token: sampled.logprobs[i]}
                entry.update(sampled.top_logprobs[i])
                seq.logprobs.append(entry)
                out.new_logprobs.append(entry)
            reason = self._finish_reason(seq, token)
            if off_grammar:
                # Cannot happen while the mask holds; a broken output must never end as "stop".
                logger.error("request_id=%s: sampled token %d does not follow its %s", seq.request_id, token,
                             seq.params.structured.kind if seq.params.structured else "grammar")
                reason = "abort"
            if reason is not None:
                self.scheduler.finish(seq, reason, keep_blocks=self.keep_finished_blocks)
                self.sequences.pop(seq.request_id, None)
                if self.keep_finished_blocks:
                    self.held[seq.request_id] = seq
                out.finished, out.finish_reason = True, reason
            outputs.append(out)
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if seq.grammar is not None and seq.grammar.is_terminated:
            return "stop"   # it took an end-of-sequence token, which it allows only once complete
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def close(self) -> None:
        self.runner.close()


def _prompt_chunks(batch: ScheduledBatch) -> list[PromptChunk]:
    return [PromptChunk(seq.request_id, seq.block_ids, seq.num_computed_tokens, seq.num_computed_tokens + num_new,
                        seq.num_computed_tokens + num_new == seq.num_tokens) for seq, num_new in batch.prefills]


def _sampling_request(seq: Sequence) -> SamplingRequest:
    """What the sampler sees of ``seq``: a resumed request's output starts in its prompt's tail."""
    num_resumed = seq.params.num_resumed_tokens
    if not num_resumed:
        return SamplingRequest(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator, seq.grammar)
    split = len(seq.prompt_token_ids) - num_resumed
    return SamplingRequest(seq.params, seq.prompt_token_ids[:split],
                           seq.prompt_token_ids[split:] + seq.output_token_ids, seq.generator, seq.grammar)
