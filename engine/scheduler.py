"""Continuous-batching scheduler: chunked prefill plus decode in one step, with retraction.

Runs in the engine thread. It decides which tokens of which sequences run next and owns their
KV blocks through the BlockAllocator; it never touches tensors.

Every scheduled sequence computes some of its not-yet-cached tokens: a decode is a chunk of
exactly one token (the last sampled one), a prefill chunk is a run of a prompt's tokens. A step
holds at most ``chunked_prefill_size`` tokens, its decodes included (vLLM's
max_num_batched_tokens), so prefill chunks fill what the decodes leave (at least a quarter of it,
so prefill never stalls behind a big decode batch). Counting the decodes keeps a busy step at
the size it was tuned for: oneDNN's GEMMs cost by blocks of rows, and on 2 AMX cores a
SmolLM2 layer's linears took 1.9 ms for 257-512 rows but 2.8-3.1 ms for 513-640, so 512 prefill
tokens plus 7 decodes cost a third more than 505 plus 7. A sequence samples when its chunk
reaches its last token.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockAllocator
from engine.config import SchedulerConfig
from engine.math_utils import cdiv
from engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

# SGLang's new_token_ratio: the share of a running request's remaining max_tokens that
# admission keeps free for it. Starts at 0.7 x conservativeness, decays per decode step,
# and jumps back up after a retraction.
_INIT_RATIO, _MIN_RATIO, _RATIO_DECAY = 0.7, 0.14, 0.001
_RETRACT_DECODE_STEPS = 20


def _salt(seq: Sequence) -> bytes:
    """The prefix-cache key of a request's first block: requests with different salts share none."""
    return seq.params.cache_salt.encode()


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num_new_tokens)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def kind(self) -> str:
        """"prefill" (prompt chunks only), "decode" (decodes only) or "mixed"."""
        return "mixed" if self.prefills and self.decodes else "prefill" if self.prefills else "decode"


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, max_model_len: int) -> None:
        if config.chunked_prefill_size < 1:
            raise ValueError("the scheduler needs a resolved chunked_prefill_size (see resolve_chunked_prefill_size)")
        self.config = config
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.init_ratio = min(1.0, _INIT_RATIO * config.schedule_conservativeness)
        self.min_ratio = min(self.init_ratio, _MIN_RATIO * config.schedule_conservativeness)
        self.new_token_ratio = self.init_ratio
        self.num_retracted_total = 0

    # -- requests -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._release(seq)
                    seq.finish("abort")
                    return seq
        return None

    def finish(self, seq: Sequence, reason: str, keep_blocks: bool = False) -> None:
        """End ``seq``; with ``keep_blocks`` its blocks stay referenced until ``release``."""
        self.running.remove(seq)
        if not keep_blocks:
            self._release(seq)
        seq.finish(reason)

    def release(self, seq: Sequence) -> None:
        """Free the blocks of a sequence that finished with ``keep_blocks``."""
        self._release(seq)

    def can_reserve(self, num_blocks: int, future_tokens: int) -> bool:
        """Whether ``num_blocks`` fit beside what running requests are expected to generate."""
        reserved = self._reserved_blocks() + int(future_tokens * self.new_token_ratio) // self.block_size
        return num_blocks + reserved <= self.allocator.num_free_blocks

    def add_running(self, seq: Sequence) -> None:
        """Insert a sequence whose blocks and computed tokens were set up elsewhere."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._schedule_decodes(batch)
        size = self.config.chunked_prefill_size
        budget = max(size - len(batch.decodes), cdiv(size, 4))   # the decodes count (module docstring)
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncomputed_tokens > 1:
                num_new = min(seq.num_uncomputed_tokens, budget)
                if not self._grow(seq, seq.num_computed_tokens + num_new):
                    break
                batch.prefills.append((seq, num_new))
                budget -= num_new
        self._admit(batch, budget)
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        if not decoding:
            return
        needed = sum(1 for s in decoding if self._blocks_for(s.num_tokens) > len(s.block_ids))
        retracted = []
        while needed > self.allocator.num_free_blocks and decoding:
            victim = min(decoding, key=lambda s: (len(s.output_token_ids), -s.arrival_s))
            decoding.remove(victim)
            if self._blocks_for(victim.num_tokens) > len(victim.block_ids):
                needed -= 1
            self._retract(victim)
            retracted.append(victim)
        if retracted:
            self._raise_ratio(len(retracted))
        for seq in decoding:
            self._grow(seq, seq.num_tokens)
        batch.decodes = decoding
        self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - _RATIO_DECAY)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        if self.config.schedule_policy == "lpm" and len(self.waiting) > 1:
            ranked = sorted(self.waiting, key=lambda s: -self.allocator.peek_prefix_blocks(s.all_token_ids, _salt(s)))
            self.waiting = deque(ranked)
        reserved = self._reserved_blocks()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_hits = self.allocator.peek_prefix_blocks(seq.all_token_ids, _salt(seq))
            num_computed = num_hits * self.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            # Admit only with room for this chunk, and, while others run, for the whole prompt
            # plus its first output and what running requests are expected to still generate.
            # Hit blocks sitting in the free queue stop being free once touched.
            free = self.allocator.num_free_blocks - num_hits
            needed = self._blocks_for(num_computed + num_new) - num_hits
            prompt_blocks = self._blocks_for(seq.num_tokens + 1) - num_hits
            if needed > free or (self.running and prompt_blocks + reserved > free):
                break
            self.waiting.popleft()
            hits = self.allocator.match_prefix(seq.all_token_ids, _salt(seq))
            seq.block_ids = hits + self.allocator.allocate(needed)
            seq.num_computed_tokens = num_computed
            seq.num_cached_blocks = num_hits
            if not seq.output_token_ids:
                seq.num_prefix_hit_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.prefills.append((seq, num_new))
            budget -= num_new
            reserved += self._future_blocks(seq)

    # -- blocks ---------------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        extra = self._blocks_for(num_tokens) - len(seq.block_ids)
        if extra <= 0:
            return True
        if extra > self.allocator.num_free_blocks:
            return False
        seq.block_ids += self.allocator.allocate(extra)
        return True

    def _future_blocks(self, seq: Sequence) -> int:
        remaining = min(seq.params.max_tokens - len(seq.output_token_ids),
                        self.max_model_len - seq.num_tokens)
        return int(max(0, remaining) * self.new_token_ratio) // self.block_size

    def _reserved_blocks(self) -> int:
        return sum(self._future_blocks(s) for s in self.running)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if seq.num_computed_tokens // self.block_size <= seq.num_cached_blocks:
            return   # no block filled since the last call (most decode steps): skip copying the tokens
        seq.num_cached_blocks = self.allocator.cache_full_blocks(
            seq.block_ids, seq.all_token_ids[:seq.num_computed_tokens], seq.num_cached_blocks, _salt(seq))

    def _release(self, seq: Sequence) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so they
        # should be evicted first.
        self.allocator.free(seq.block_ids[::-1])
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

    def _retract(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_retractions += 1
        self.num_retracted_total += 1
        self.waiting.appendleft(seq)

    def _raise_ratio(self, num_retracted: int) -> None:
        old = self.new_token_ratio
        decoded = sum(len(s.output_token_ids) for s in self.running)
        max_new = sum(s.params.max_tokens for s in self.running)
        new = (decoded + _RETRACT_DECODE_STEPS * len(self.running)) / (max_new + 1)
        self.new_token_ratio = min(1.0, max(new, old))
        logger.warning("decode out of memory happened, #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
                       num_retracted, old, self.new_token_ratio)
