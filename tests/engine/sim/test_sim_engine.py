"""The simulated engine in process: deterministic tokens read from a real KV pool, resumed
streams equal to undisturbed ones, steps that sleep the modelled time, and its config."""
from __future__ import annotations

import time

import pytest
import torch

from engine.config import DEFAULT_MODEL, CacheConfig, ModelConfig, SamplingParams, SchedulerConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sim.tokens import DIGEST_SEED, chain, next_token, prompt_digest
from tests.engine.sim.profiles import write_fast_profile

VOCAB = 49152   # SmolLM2's, the default tokenizer of a profile
PROMPTS = [[7, 8, 9] * 11, [300, 301], list(range(1000, 1100))]


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return write_fast_profile(tmp_path_factory.mktemp("sim") / "fast.json")


@pytest.fixture(scope="module")
def llm(profile):
    llm = LLM(f"sim:{profile}", num_gpu_blocks_override=64, max_model_len=256, shared_memory=False,
              chunked_prefill_size=32)
    yield llm
    llm.close()


def expected(prompt: list[int], num_tokens: int) -> list[int]:
    digest = prompt_digest(prompt)
    return [next_token(digest, len(prompt) + i, VOCAB) for i in range(num_tokens)]


def test_tokens_are_a_hash_of_the_prompt_and_position(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]
    for prompt, a, b in zip(PROMPTS, together, alone):
        assert a.token_ids == b.token_ids == expected(prompt, 6)
    assert together[0].token_ids != together[1].token_ids
    # sampling at a sane temperature, seeded or not, picks the same token
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=5))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in together]


def test_a_resumed_stream_continues_the_undisturbed_one(llm):
    prompt = PROMPTS[2]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].token_ids
    for k in (1, 4, 9):   # what a failover re-sends: prompt + the k tokens already streamed
        resumed = llm.generate([prompt + full[:k]], SamplingParams(temperature=0, max_tokens=10 - k,
                                                                   ignore_eos=True, num_resumed_tokens=k))[0]
        assert resumed.token_ids == full[k:]


def test_logprobs_rows_go_through_the_real_sampler(llm):
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2))[0]
    assert out.token_ids == expected(PROMPTS[1], 3)
    assert [entry[t] for entry, t in zip(out.logprobs, out.token_ids)] == [0.0, 0.0, 0.0]


def test_the_pool_holds_tokens_positions_and_prefix_digests(profile):
    engine = LLMEngine(ModelConfig(model=f"sim:{profile}", max_model_len=128),
                       CacheConfig(num_gpu_blocks_override=16, shared_memory=False), SchedulerConfig(),
                       keep_finished_blocks=True)
    try:
        prompt = PROMPTS[0]   # 33 tokens: three 16-token blocks
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        held = engine.held["r"]
        ints = engine.kv_pool.tensor.view(torch.int32)[0]   # [K|V, blocks, block_size, 1 head, 4]
        tokens = prompt + held.output_token_ids[:1]           # the last output token's KV is never written
        digest = DIGEST_SEED
        for position, token_id in enumerate(tokens):
            digest = chain(digest, token_id)
            block, offset = held.block_ids[position // 16], position % 16
            assert ints[0, block, offset, 0].tolist() == [token_id, position, 0, 0]
            assert ints[1, block, offset, 0].tolist() == [digest, 0, 0, 0]
        # The next token comes from the pool, not from the request's ids: the same prompt on
        # blocks holding a copy of this KV (what a prefill worker's transfer writes) continues the
        # stream; with the prompt's last digest corrupted, it does not.
        src_blocks = list(held.block_ids)
        engine.release("r")
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        first = expected(prompt, 1)[0]
        streams = {}
        for request_id in ("copied", "corrupted"):
            blocks = engine.reserve_blocks(len(prompt) + 1, 8, transfers_pending=False)
            assert blocks is not None and not set(blocks) & set(src_blocks[:3])
            for kv in (0, 1):
                ints[kv, blocks[:3]] = ints[kv, src_blocks[:3]]
            if request_id == "corrupted":
                ints[1, blocks[2], (len(prompt) - 1) % 16, 0, 0] += 1
            engine.add_prefilled(request_id, prompt, params, blocks, first)
            streams[request_id] = [first]
            while engine.has_unfinished():
                for out in engine.step():
                    streams[out.request_id] += out.new_token_ids
        assert streams["copied"] == expected(prompt, 3)
        assert streams["corrupted"][1:] != expected(prompt, 3)[1:]
    finally:
        engine.close()


def test_a_step_sleeps_the_modelled_time_and_burns_no_cpu(profile):
    engine = LLMEngine(ModelConfig(model=f"sim:{profile}", max_model_len=2048),
                       CacheConfig(num_gpu_blocks_override=1024, shared_memory=False), SchedulerConfig())
    try:
        for i in range(8):
            engine.add_request(f"r{i}", [5 + i] * 500, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        while engine.scheduler.waiting or any(s.num_computed_tokens < 500 for s in engine.scheduler.running):
            engine.step()
        running = list(engine.scheduler.running)
        num_context_tokens = sum(s.num_tokens for s in running)
        assert len(running) == 8 and num_context_tokens >= 8 * 501
        wall, cpu = time.perf_counter(), time.process_time()
        engine.step()   # 8 decodes, none prefilling
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        predicted_s = engine.runner.latency.step_ms(8, num_context_tokens, 0) / 1e3
        assert predicted_s == pytest.approx((2.0 + 8 * 0.05 + num_context_tokens * 0.001) / 1e3, rel=1e-6)
        assert predicted_s <= wall < predicted_s + 0.05
        assert cpu < wall / 2
    finally:
        engine.close()


def test_config_one_spelling_of_a_simulated_model(profile):
    by_flags = ModelConfig(engine="sim", sim_profile=str(profile))
    by_name = ModelConfig(model=f"sim:{profile}")
    assert by_flags == by_name
    assert (by_name.engine, by_name.sim_profile, by_name.model) == ("sim", str(profile), f"sim:{profile}")
    assert ModelConfig(model="sim:llama-3.1-8b-h100").sim_profile == "llama-3.1-8b-h100"
    with pytest.raises(ValueError, match="needs --sim-profile"):
        ModelConfig(engine="sim")
    with pytest.raises(ValueError, match="is for --engine sim"):
        ModelConfig(sim_profile=str(profile))
    with pytest.raises(ValueError, match="leave --model out"):
        ModelConfig(model="/some/model.gguf", engine="sim", sim_profile=str(profile))
    with pytest.raises(ValueError, match="two profiles"):
        ModelConfig(model=f"sim:{profile}", sim_profile="llama-3.1-8b-h100")
    assert ModelConfig().model == DEFAULT_MODEL and ModelConfig().engine == "torch"
