"""A prefill worker + a decode worker give exactly what the colocated `LLM` gives.

Real processes on the tiny random-weight Llama (tests/workers/conftest.py), KV pushed over
kvtransfer's shm, tcp and nixl backends in turn (nixl over UCX's TCP transport, as between
nodes). Greedy tokens, logprobs and seeded sampling must
equal the in-process `LLM` run on the same prompts (same dtype and block size): the prefill
worker computes the prompt and samples the first token, the decode worker continues from the
KV it received, so any misplaced block, layer or generator draw changes the tokens.
"""
from __future__ import annotations

import os

import pytest

from engine.config import SamplingParams
from protos.tandem.v1 import worker_pb2
from tests.workers.harness import (
    check_greedy_matches_colocated,
    check_logprobs_match,
    generate,
    greedy,
    pool_flags,
    prompts_for,
    run_concurrently,
    start_pair,
    wait_idle,
)

LENGTHS = [3, 90, 17, 33, 64, 5, 48, 16, 81, 29, 12, 70, 9, 55, 40, 24]
MAX_TOKENS = [5, 24, 12, 8, 20, 24, 6, 15, 10, 18, 24, 7, 22, 11, 16, 9]


@pytest.fixture(scope="module", params=["shm", "tcp", "nixl"])
def pair(request, spawn_module, tiny_dir):
    backend = request.param
    if backend == "shm":   # the session's shared pair (tests/workers/conftest.py) runs on shm
        yield request.getfixturevalue("pd_pair")
        return
    if backend == "nixl":
        os.environ.setdefault("UCX_TLS", "tcp,self")   # the workers inherit it: UCX over loopback TCP
    flags = [*pool_flags(), "--kv-backend", backend, "--log-interval-s", "1"]
    prefill, decode = start_pair(spawn_module, tiny_dir, *flags, names=(f"prefill-{backend}", f"decode-{backend}"))
    yield prefill, decode
    wait_idle(prefill, decode)


def test_sixteen_concurrent_greedy_requests_match_colocated(pair, reference):
    prefill, decode = pair
    results = check_greedy_matches_colocated(prefill, decode, reference, LENGTHS, MAX_TOKENS, seed=1000, tag="greedy")
    for i, result in enumerate(results):
        final = result.final
        assert (final.num_prompt_tokens, final.num_output_tokens) == (LENGTHS[i], MAX_TOKENS[i])
        assert all(not r.finish_reason for r in result.responses[:-1])
    assert decode.stats().kv_blocks_total == 256


def test_logprobs_match_colocated(pair, reference):
    prefill, decode = pair
    prompts = prompts_for([7, 37, 20], seed=2000)
    expected = reference(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3))
    results = run_concurrently([
        (lambda i=i: generate(prefill, decode, f"logprobs-{i}", prompts[i], greedy(6, logprobs=3)))
        for i in range(len(prompts))])
    assert len(results) == len(expected) == len(prompts)
    for result, ref in zip(results, expected):
        assert result.error is None, result.error
        assert result.token_ids == ref.token_ids
        assert len(result.logprobs) == 6
        check_logprobs_match(result, ref, num_top=3)


def test_no_logprobs_unless_asked(pair):
    prefill, decode = pair
    [prompt] = prompts_for([11], seed=2500)
    result = generate(prefill, decode, "no-logprobs", prompt, greedy(4))
    assert result.error is None
    assert len(result.token_ids) == 4
    assert result.logprobs == []


def test_seeded_sampling_matches_colocated(pair, reference):
    """The decode worker skips the draw the prefill worker made for the first token."""
    prefill, decode = pair
    prompts = prompts_for([10, 45, 23], seed=3000)
    seeds = [11, 11, 12345]
    expected = reference(prompts, [SamplingParams(temperature=0.8, seed=s, max_tokens=12, ignore_eos=True)
                                   for s in seeds])

    def sampling(seed: int) -> worker_pb2.SamplingParams:
        return worker_pb2.SamplingParams(temperature=0.8, seed=seed, max_tokens=12, ignore_eos=True)

    results = run_concurrently([
        (lambda i=i: generate(prefill, decode, f"seeded-{i}", prompts[i], sampling(seeds[i])))
        for i in range(len(prompts))])
    for result, ref in zip(results, expected):
        assert result.error is None, result.error
        assert result.token_ids == ref.token_ids
    # Not a vacuous check: at temperature 0.8 the draws differ from greedy decoding.
    greedy_ref = reference(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert any(r.token_ids != g.token_ids for r, g in zip(results, greedy_ref))


@pytest.mark.slow
def test_smollm2_chat_matches_colocated(spawn, tmp_path):
    from engine.config import DEFAULT_MODEL
    from engine.llm import LLM

    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    llm = LLM(DEFAULT_MODEL, dtype="float32", device="cpu", num_gpu_blocks_override=64, max_model_len=512)
    try:
        [ref] = llm.chat([conversation], params)
    finally:
        llm.close()
    flags = ["--num-gpu-blocks-override", "64", "--max-model-len", "512"]
    prefill, decode = start_pair(spawn, DEFAULT_MODEL, *flags)
    result = generate(prefill, decode, "smollm2-chat", ref.prompt_token_ids,
                      worker_pb2.SamplingParams(temperature=0.0, max_tokens=32))
    assert result.error is None, result.error
    assert result.token_ids == ref.token_ids
    assert result.final.finish_reason == ref.finish_reason
    assert "Paris" in ref.text
