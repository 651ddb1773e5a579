"""Simulated prefill + decode worker processes (``--model sim:PROFILE``): the prompt's tiny KV
crosses kvtransfer (shm) into the decode worker's pool, and the stream equals the colocated
simulated engine's -- the decode worker reads the prompt's digest from the transferred KV, so a
misplaced block changes its tokens (tests/engine/sim/test_sim_engine.py shows that)."""
from __future__ import annotations

import re

import pytest

from engine.config import SamplingParams
from engine.llm import LLM
from tests.engine.sim.profiles import write_fast_profile
from tests.metrics import scrape
from tests.workers.harness import (
    POOL_BLOCKS,
    generate,
    greedy,
    pool_flags,
    prompts_for,
    run_concurrently,
    start_pair,
    wait_idle,
)

LENGTHS = [3, 90, 17, 33, 64, 5]
MAX_TOKENS = [5, 24, 12, 8, 20, 3]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return f"sim:{write_fast_profile(tmp_path_factory.mktemp('sim') / 'fast.json')}"


def test_pd_stream_equals_colocated_sim(spawn_module, model):
    flags = [*pool_flags(), "--max-model-len", "1024", "--kv-backend", "shm", "--log-interval-s", "1"]
    prefill, decode = start_pair(spawn_module, model, *flags, names=("sim-prefill", "sim-decode"))
    prompts = prompts_for(LENGTHS, seed=4000)
    results = run_concurrently([
        (lambda i=i: generate(prefill, decode, f"sim-{i}", prompts[i], greedy(MAX_TOKENS[i])))
        for i in range(len(prompts))])
    llm = LLM(model, num_gpu_blocks_override=POOL_BLOCKS, max_model_len=1024, shared_memory=False)
    try:
        expected = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                          for n in MAX_TOKENS])
    finally:
        llm.close()
    for result, ref, n in zip(results, expected, MAX_TOKENS):
        assert result.error is None, result.error
        assert result.token_ids == ref.token_ids and len(ref.token_ids) == n
    stats = decode.stats()
    assert stats.kv_blocks_total == POOL_BLOCKS
    assert "sim:" in stats.model and "kv=1x1x4/16" in stats.fingerprint
    wait_idle(prefill, decode)
    # every prompt's blocks crossed: (2 x 1 layer x 16 tokens x 4 values x 4 bytes) per block
    blocks = sum(-(-n // 16) for n in LENGTHS)
    moved = re.search(r"^tandem_kv_transfer_bytes_total\{[^}]*\} (\S+)$", scrape(prefill.metrics), re.M)
    assert moved is not None and float(moved.group(1)) == blocks * 2 * 16 * 4 * 4
