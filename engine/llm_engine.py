"""The colocated engine loop: schedule, run, postprocess — prefill and decode in one process.

Runs on whichever thread calls ``step()`` (the `LLM` API's caller, or a worker's engine thread).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.block_manager import BlockAllocator
from engine.config import CacheConfig, ModelConfig, SamplingParams, SchedulerConfig
from engine.loader import ModelSource
from engine.model_runner import ModelRunner
from engine.sampler import Sampler, SamplerOutput, SamplingRequest, make_generator
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None


def load_tokenizer(source: ModelSource) -> Tokenizer:
    if source.kind == "gguf":
        return Tokenizer.from_gguf(source.path)
    return Tokenizer.from_hf_dir(source.path)


class LLMEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig) -> None:
        self.runner = ModelRunner(model_config, cache_config, scheduler_config.chunked_prefill_size)
        try:
            self.tokenizer = load_tokenizer(self.runner.source)
        except BaseException:
            self.runner.close()  # do not leave the /dev/shm pool behind
            raise
        self.max_model_len = self.runner.max_model_len
        self.allocator = BlockAllocator(self.runner.num_blocks, cache_config.block_size,
                                        cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.allocator, self.max_model_len)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | set(self.runner.arch.eos_token_ids)
        self.sequences: dict[str, Sequence] = {}

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
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_s=time.monotonic(),
                       generator=make_generator(params.seed, self.runner.device))
        self.sequences[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        logits = self.runner.execute(batch)
        sampling = self._sampling_seqs(batch)
        sampled = self.sampler(logits, [SamplingRequest(s.params, s.prompt_token_ids, s.output_token_ids,
                                                        s.generator) for s in sampling])
        return self._postprocess(batch, sampling, sampled)

    def _sampling_seqs(self, batch: ScheduledBatch) -> list[Sequence]:
        seqs = [s for s, n in batch.prefills if s.num_computed_tokens + n == s.num_tokens]
        return seqs + batch.decodes

    def _postprocess(self, batch: ScheduledBatch, sampling: list[Sequence],
                     sampled: SamplerOutput) -> list[StepOutput]:
        for seq, num_new in batch.prefills:
            seq.num_computed_tokens += num_new
            self.scheduler.cache_computed_blocks(seq)
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
            self.scheduler.cache_computed_blocks(seq)
        outputs = []
        for i, seq in enumerate(sampling):
            token = sampled.token_ids[i]
            seq.output_token_ids.append(token)
            out = StepOutput(seq.request_id, [token])
            if seq.params.logprobs is not None:
                entry = {token: sampled.logprobs[i]}
                entry.update(sampled.top_logprobs[i])
                seq.logprobs.append(entry)
                out.new_logprobs.append(entry)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.sequences.pop(seq.request_id, None)
                out.finished, out.finish_reason = True, reason
            outputs.append(out)
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def close(self) -> None:
        self.runner.close()
