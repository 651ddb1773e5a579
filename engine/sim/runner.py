"""The simulated model runner: the ModelRunner interface without a model.

Runs in the engine thread of a worker started with ``--engine sim`` (or the caller's thread in
``LLM``). ``LLMEngine`` builds it instead of ``engine.model_runner.ModelRunner`` and uses it the
same way: it owns a real KV pool (in /dev/shm on CPU, so kvtransfer maps and writes it as it
does a real one), and ``execute`` computes one step. Here a step writes each scheduled token's KV
slot (engine/sim/tokens.py: token, position, prefix digest), reads back the digest of each
sampling sequence's original prompt, and sleeps until the latency model's step time has passed
(engine/sim/latency.py), using no CPU meanwhile. It returns the next token of each sampling row
(``SimSampler`` turns them into the sampler's output), in the order of the real runner's logits.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.config import CacheConfig, ModelConfig, ParallelConfig, resolve_chunked_prefill_size
from engine.kv_cache import KVPool, KVPoolShape, capacity_lines
from engine.model_source import load_arch, resolve_model
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.sim.arch import SIM_HEAD_DIM, sim_arch
from engine.sim.latency import LatencyModel, kv_cache_tokens, load_profile, profile_path
from engine.sim.tokens import DIGEST_SEED, chain, next_token

logger = logging.getLogger(__name__)

K_TOKEN, K_POSITION = 0, 1   # the K row of a slot: (token id, position, 0, 0)
V_DIGEST = 0                 # the V row: (prefix digest, 0, 0, 0)


class SimRunner:
    """``execute`` writes the step's KV, computes the next tokens and sleeps the modelled time."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, max_num_batched_tokens: int,
                 parallel: ParallelConfig = ParallelConfig()) -> None:
        if parallel.tensor_parallel_size > 1:
            raise ValueError("the simulated engine has no tensor parallelism: use --tensor-parallel-size 1 "
                             "(a profile measured with TP already models its step times)")
        assert model_config.sim_profile is not None, "ModelConfig checks that --engine sim has a profile"
        self.parallel = parallel
        self.device = torch.device("cpu")
        self.dtype = torch.float32       # the pool holds int32 bit patterns in float32 slots
        self.max_num_batched_tokens = resolve_chunked_prefill_size(max_num_batched_tokens, on_cuda=False)
        self.profile_path = profile_path(model_config.sim_profile)
        profile = load_profile(str(self.profile_path))
        self.latency = LatencyModel.fit(profile)
        self.source = resolve_model(model_config.model)   # sim:PROFILE -> the tokenizer model's files
        self.arch = sim_arch(load_arch(self.source))
        self.max_model_len = model_config.max_model_len or self.arch.max_position_embeddings
        self.block_size = cache_config.block_size
        self.group = None                # no TP group, no leader: LLMEngine's TP paths stay off
        self.leader = None
        num_blocks = cache_config.num_gpu_blocks_override or (
            kv_cache_tokens(profile, cache_config.kv_cache_memory) // self.block_size)
        if num_blocks * self.block_size < self.max_model_len:
            raise ValueError(f"the simulated KV pool holds {num_blocks} blocks x {self.block_size} tokens, less "
                             f"than one max_model_len={self.max_model_len} sequence; lower --max-model-len or give "
                             "more blocks (--num-gpu-blocks-override, --kv-cache-memory)")
        self.layout = KVPoolShape(1, 1, SIM_HEAD_DIM, self.block_size, self.dtype)
        self.kv_pool: KVPool | None = KVPool(self.layout, num_blocks, self.device,
                                             shared_memory=cache_config.shared_memory)
        slots = self.kv_pool.tensor.view(torch.int32)[0]      # [2, num_blocks, block_size, 1, head_dim]
        self._keys = slots[0].view(-1, SIM_HEAD_DIM)          # [num_slots, head_dim]
        self._values = slots[1].view(-1, SIM_HEAD_DIM)
        m = self.latency
        logger.info("simulated engine: profile %s, tokenizer %s; step ms = %.3f + %.4f/seq + %.3g/context token "
                    "+ %.4f/prefill token", self.profile_path, self.source.path, m.base_ms, m.per_seq_ms,
                    m.per_context_token_ms, m.per_prefill_token_ms)
        for line in capacity_lines(num_blocks, self.block_size, self.max_model_len):
            logger.info(line)

    @property
    def num_blocks(self) -> int:
        assert self.kv_pool is not None, "the KV pool is allocated in __init__"
        return self.kv_pool.num_blocks

    def _slot(self, seq: Sequence, position: int) -> int:
        # slot = block_id * block_size + offset within the block
        return seq.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _write(self, spans: list[tuple[Sequence, int, int]]) -> None:
        """The KV of each span's positions [start, end): (token, position) in K, the chained
        digest in V. One gather and one scatter per step, not per sequence: with ~100 decode
        sequences a step's per-sequence tensor calls were most of a simulated worker's CPU."""
        continued = [(seq, start) for seq, start, _ in spans if start > 0]
        previous = self._values[self._slots(continued, -1), V_DIGEST].tolist() if continued else []
        digests = iter(previous)
        slots: list[int] = []
        token_ids: list[int] = []
        positions: list[int] = []
        chained: list[int] = []
        for seq, start, end in spans:
            digest = next(digests) if start > 0 else DIGEST_SEED
            for position, token_id in enumerate(_token_ids(seq, start, end), start):
                digest = chain(digest, token_id)
                slots.append(self._slot(seq, position))
                token_ids.append(token_id)
                positions.append(position)
                chained.append(digest)
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.long)
        keys = torch.zeros(len(slots), SIM_HEAD_DIM, dtype=torch.int32)
        keys[:, K_TOKEN] = torch.tensor(token_ids, dtype=torch.int32)
        keys[:, K_POSITION] = torch.tensor(positions, dtype=torch.int32)
        values = torch.zeros(len(slots), SIM_HEAD_DIM, dtype=torch.int32)
        values[:, V_DIGEST] = torch.tensor(chained, dtype=torch.int32)
        self._keys[index] = keys
        self._values[index] = values

    def _slots(self, at: list[tuple[Sequence, int]], offset: int) -> torch.Tensor:
        return torch.tensor([self._slot(seq, position + offset) for seq, position in at], dtype=torch.long)

    def _next_tokens(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's next token, from the digest of its original prompt (a resumed
        request's prompt ends with ``num_resumed_tokens`` of output) read from the pool."""
        slots, rows = [], []
        for i, seq in enumerate(seqs):
            num_original = len(seq.prompt_token_ids) - seq.params.num_resumed_tokens
            if num_original > 0:
                slots.append(self._slot(seq, num_original - 1))
                rows.append(i)
        digests = [DIGEST_SEED] * len(seqs)
        if slots:
            read = self._values[torch.tensor(slots, dtype=torch.long), V_DIGEST].tolist()
            for i, digest in zip(rows, read):
                digests[i] = digest
        return [next_token(d, s.num_tokens, self.arch.vocab_size) for d, s in zip(digests, seqs)]

    def tune_kernels(self) -> None:
        """Nothing to time: a simulated step sleeps what the profile says."""

    def execute(self, batch: ScheduledBatch, after_layer: Callable[[int], None] | None = None,
                extra: dict[str, Any] | None = None) -> torch.Tensor:
        """One step; the next token id of each sampling row ``[num_sampling_seqs]`` (int64), in
        the real runner's row order: prefills that complete their prompt, then decodes."""
        started = time.perf_counter()
        sampling = []
        spans = []
        for seq, num_new in batch.prefills:
            end = seq.num_computed_tokens + num_new
            spans.append((seq, seq.num_computed_tokens, end))
            if end == seq.num_tokens:
                sampling.append(seq)
        num_context_tokens = 0
        for seq in batch.decodes:
            spans.append((seq, seq.num_tokens - 1, seq.num_tokens))
            num_context_tokens += seq.num_tokens
            sampling.append(seq)
        self._write(spans)
        token_ids = self._next_tokens(sampling)
        if after_layer is not None:
            after_layer(0)   # the one layer's KV is in place: a prefill worker ships it now
        step_s = self.latency.step_ms(len(batch.decodes), num_context_tokens, batch.num_prefill_tokens) / 1e3
        remaining_s = started + step_s - time.perf_counter()
        if remaining_s > 0:
            time.sleep(remaining_s)
        return torch.tensor(token_ids, dtype=torch.long)

    def close(self) -> None:
        if self.kv_pool is not None:
            self.kv_pool.close()
            self.kv_pool = None


def _token_ids(seq: Sequence, start: int, end: int) -> list[int]:
    """``seq.all_token_ids[start:end]`` without building the whole list (a decode step asks
    for one token of a sequence thousands long)."""
    num_prompt = len(seq.prompt_token_ids)
    if start >= num_prompt:
        return seq.output_token_ids[start - num_prompt:end - num_prompt]
    if end <= num_prompt:
        return seq.prompt_token_ids[start:end]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[:end - num_prompt]
