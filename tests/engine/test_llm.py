"""Tests for engine/llm.py and engine/llm_engine.py: the whole colocated engine on a tiny model.

One untied GQA Llama checkpoint (tests/models.py) serves every test; transformers is
the reference. A greedy request must give the same tokens whatever shares its batch, however
its prefill is chunked, whether its prefix came from the cache, and after being retracted; the
KV pool must end every test with no block in use.
"""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from engine.config import SamplingParams
from tests.models import greedy, hf_greedy, hf_logits, random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "llama"


def contiguous_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with no KV cache at all: the whole sequence is re-run every step."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def record_batches(llm) -> list[tuple[list[tuple[str, int]], list[str]]]:
    """Record every scheduled batch as ([(request_id, num_prefill_tokens)], [decode request_id])."""
    seen = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        batch = schedule()
        seen.append(([(s.request_id, n) for s, n in batch.prefills], [s.request_id for s in batch.decodes]))
        return batch

    llm.engine.scheduler.schedule = recording
    return seen


@pytest.fixture
def model_dir(tiny_model_dir):
    return tiny_model_dir(MODEL)


@pytest.fixture
def hf(hf_model):
    return hf_model(MODEL)


# -- greedy invariance --------------------------------------------------------------------------

def test_paged_greedy_matches_contiguous_no_cache_reference(model_dir, hf, make_llm):
    llm = make_llm(model_dir)
    prompt = random_prompt(seed=1, num_tokens=30)
    [out] = llm.generate(prompt, greedy(16))
    assert out.token_ids == contiguous_greedy(hf, prompt, 16)
    assert out.token_ids == hf_greedy(hf, prompt, 16)
    assert llm.engine.allocator.num_used_blocks == 0


def test_greedy_same_alone_and_in_a_mixed_batch_of_eight(model_dir, hf, make_llm):
    lengths = [3, 40, 17, 1, 64, 16, 33, 9]
    max_tokens = [16, 5, 12, 16, 3, 16, 8, 1]
    prompts = [random_prompt(seed=100 + i, num_tokens=n) for i, n in enumerate(lengths)]
    llm = make_llm(model_dir)
    [alone] = llm.generate(prompts[0], greedy(16))
    batches = record_batches(llm)
    outs = llm.generate(prompts, [greedy(m) for m in max_tokens])
    # Everything was prefilled together in one step, then decoded together.
    assert batches[0] == ([(o.request_id, n) for o, n in zip(outs, lengths)], [])
    assert len(batches[1][1]) == 7  # the max_tokens=1 request finished at its prefill
    assert outs[0].token_ids == alone.token_ids
    for out, prompt, m in zip(outs, prompts, max_tokens):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(hf, prompt, m)
        assert out.finish_reason == "length"
    assert llm.engine.allocator.num_used_blocks == 0


def test_prefix_cache_hits_give_the_same_tokens(model_dir, hf, make_llm):
    llm = make_llm(model_dir)
    allocator = llm.engine.allocator
    common = random_prompt(seed=2, num_tokens=48)  # exactly 3 blocks
    first = common + random_prompt(seed=3, num_tokens=10)
    second = common + random_prompt(seed=4, num_tokens=7)
    llm.generate(first, greedy(4))
    hits_before = allocator.num_prefix_hit_tokens
    [out] = llm.generate(second, greedy(16))
    assert allocator.num_prefix_hit_tokens - hits_before == 48
    assert out.token_ids == hf_greedy(hf, second, 16)
    assert allocator.num_used_blocks == 0


def test_prefix_cache_reuses_blocks_written_by_decode(model_dir, hf, make_llm):
    llm = make_llm(model_dir)
    allocator = llm.engine.allocator
    prompt = random_prompt(seed=5, num_tokens=40)
    [out] = llm.generate(prompt, greedy(16))
    # The same prompt again: its 2 full blocks (never the last token) are hits.
    hits = allocator.num_prefix_hit_tokens
    [again] = llm.generate(prompt, greedy(16))
    assert allocator.num_prefix_hit_tokens - hits == 32
    assert again.token_ids == out.token_ids
    # Prompt + 10 generated tokens: block 2 (tokens 32..47) was filled during decode.
    hits = allocator.num_prefix_hit_tokens
    [follow] = llm.generate(prompt + out.token_ids[:10], greedy(6))
    assert allocator.num_prefix_hit_tokens - hits == 48
    assert follow.token_ids == out.token_ids[10:]
    assert allocator.num_used_blocks == 0


def test_fully_cached_block_aligned_prompt_still_computes_its_last_token(model_dir, hf, make_llm):
    llm = make_llm(model_dir)
    prompt = random_prompt(seed=20, num_tokens=48)  # 3 full blocks, all cached after one run
    [first] = llm.generate(prompt, greedy(4))
    hits = llm.engine.allocator.num_prefix_hit_tokens
    [again] = llm.generate(prompt, greedy(4))
    assert llm.engine.allocator.num_prefix_hit_tokens - hits == 32  # block 2 holds the last token
    assert again.token_ids == first.token_ids == hf_greedy(hf, prompt, 4)


def test_prefix_caching_disabled_never_hits(model_dir, hf, make_llm):
    llm = make_llm(model_dir, enable_prefix_caching=False)
    prompt = random_prompt(seed=5, num_tokens=40)
    outs = [llm.generate(prompt, greedy(8))[0] for _ in range(2)]
    assert llm.engine.allocator.num_prefix_hit_tokens == 0
    assert outs[0].token_ids == outs[1].token_ids == hf_greedy(hf, prompt, 8)


@pytest.mark.parametrize("prompt_len, num_chunk_steps", [(40, 5), (41, 6)])
def test_chunked_prefill(model_dir, hf, make_llm, prompt_len, num_chunk_steps):
    llm = make_llm(model_dir, chunked_prefill_size=8)
    batches = record_batches(llm)
    prompt = random_prompt(seed=6, num_tokens=prompt_len)
    [out] = llm.generate(prompt, greedy(16))
    rid = out.request_id
    assert batches[:5] == [([(rid, 8)], [])] * 5
    # A 41st token left over is computed like a decode token; then 15 decode steps.
    assert batches[5:] == [([], [rid])] * (num_chunk_steps - 5 + 15)
    assert out.token_ids == hf_greedy(hf, prompt, 16)
    assert llm.engine.allocator.num_used_blocks == 0


def test_chunked_prefill_shares_steps_with_decodes(model_dir, hf, make_llm):
    llm = make_llm(model_dir, chunked_prefill_size=8)
    batches = record_batches(llm)
    short, long = random_prompt(seed=7, num_tokens=5), random_prompt(seed=8, num_tokens=30)
    outs = llm.generate([short, long], [greedy(10), greedy(6)])
    rid_short, rid_long = (o.request_id for o in outs)
    # a step holds 8 tokens, its decode included: the long prompt's chunks fill the other 7
    assert batches[:5] == [([(rid_short, 5), (rid_long, 3)], []),
                           ([(rid_long, 7)], [rid_short]),
                           ([(rid_long, 7)], [rid_short]),
                           ([(rid_long, 7)], [rid_short]),
                           ([(rid_long, 6)], [rid_short])]
    assert outs[0].token_ids == hf_greedy(hf, short, 10)
    assert outs[1].token_ids == hf_greedy(hf, long, 6)


def test_max_num_seqs_two_runs_eight_requests(model_dir, hf, make_llm):
    llm = make_llm(model_dir, max_num_seqs=2)
    batches = record_batches(llm)
    prompts = [random_prompt(seed=200 + i, num_tokens=5 + 3 * i) for i in range(8)]
    outs = llm.generate(prompts, greedy(6))
    assert max(len(prefills) + len(decodes) for prefills, decodes in batches) == 2
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == hf_greedy(hf, prompt, 6)
        assert out.finish_reason == "length"
    assert not llm.engine.has_unfinished()
    assert llm.engine.allocator.num_used_blocks == 0


def test_small_kv_pool_retracts_and_keeps_outputs(model_dir, hf, make_llm, caplog):
    # 6 blocks of 16 tokens; each request grows to 20 + 40 = 60 tokens = 4 blocks, so two
    # running requests cannot both finish: one must be retracted and recomputed later.
    prompts = [random_prompt(seed=300 + i, num_tokens=20) for i in range(4)]
    llm = make_llm(model_dir, max_model_len=64, num_gpu_blocks_override=6)
    with caplog.at_level(logging.WARNING, logger="engine.scheduler"):
        outs = llm.generate(prompts, greedy(40))
    assert llm.engine.scheduler.num_retracted_total > 0
    assert any("decode out of memory happened" in r.getMessage() for r in caplog.records)
    roomy = make_llm(model_dir, max_model_len=64, num_gpu_blocks_override=64)
    reference = roomy.generate(prompts, greedy(40))
    assert roomy.engine.scheduler.num_retracted_total == 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert outs[0].token_ids == hf_greedy(hf, prompts[0], 40)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in outs)
    assert llm.engine.allocator.num_used_blocks == 0


# -- stopping -----------------------------------------------------------------------------------

def test_stop_token_ids_end_with_the_stop_token(model_dir, hf, make_llm):
    prompt = random_prompt(seed=9, num_tokens=12)
    reference = hf_greedy(hf, prompt, 16)
    index = next(i for i in range(3, 16) if reference[i] not in reference[:i])
    llm = make_llm(model_dir)
    [out] = llm.generate(prompt, greedy(16, stop_token_ids=(reference[index], 7)))
    assert out.token_ids == reference[:index + 1]
    assert out.finish_reason == "stop"
    assert llm.engine.allocator.num_used_blocks == 0


def test_eos_from_the_tokenizer_config_stops_unless_ignored(model_dir, hf, make_llm, tmp_path,
                                                           smollm2_tokenizer):
    prompt = random_prompt(seed=10, num_tokens=12)
    reference = hf_greedy(hf, prompt, 12)
    index = next(i for i in range(2, 12) if reference[i] not in reference[:i])
    for file in model_dir.iterdir():
        shutil.copy(file, tmp_path / file.name)
    # Make a token the model is known to emit the eos token.
    eos_text = smollm2_tokenizer.id_to_token(reference[index])
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = eos_text
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    llm = make_llm(tmp_path)
    assert reference[index] in llm.engine.eos_token_ids
    [stopped] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))
    assert stopped.token_ids == reference[:index + 1]
    assert stopped.finish_reason == "stop"
    [ignored] = llm.generate(prompt, greedy(12))
    assert ignored.token_ids == reference
    assert ignored.finish_reason == "length"


def test_max_tokens_and_max_model_len_finish_with_length(model_dir, hf, make_llm):
    prompt = random_prompt(seed=11, num_tokens=30)
    reference = hf_greedy(hf, prompt, 3)
    llm = make_llm(model_dir, max_model_len=32)
    [three] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert (three.token_ids, three.finish_reason) == (reference[:2], "length")  # 30 + 2 = 32
    [one] = llm.generate(prompt[:5], SamplingParams(temperature=0.0, max_tokens=1))
    assert len(one.token_ids) == 1 and one.finish_reason == "length"
    # A prompt of exactly max_model_len still gets its one token.
    full = random_prompt(seed=12, num_tokens=32)
    [edge] = llm.generate(full, greedy(5))
    assert edge.token_ids == hf_greedy(hf, full, 1)
    assert edge.finish_reason == "length"
    assert llm.engine.allocator.num_used_blocks == 0


# -- sampling and logprobs ----------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(model_dir, make_llm):
    prompt = random_prompt(seed=13, num_tokens=20)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    llm = make_llm(model_dir)
    [alone] = llm.generate(prompt, seeded)
    others = [random_prompt(seed=14, num_tokens=9), random_prompt(seed=15, num_tokens=33)]
    batch = llm.generate([others[0], prompt, others[1], prompt],
                         [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True), seeded,
                          greedy(4), SamplingParams(temperature=1.0, seed=8, max_tokens=16, ignore_eos=True)])
    assert batch[1].token_ids == alone.token_ids
    [fresh] = make_llm(model_dir).generate(prompt, seeded)
    assert fresh.token_ids == alone.token_ids
    assert batch[3].token_ids != alone.token_ids  # another seed, another draw
    assert alone.token_ids != llm.generate(prompt, greedy(16))[0].token_ids


def _check_logprobs(out, prompt, hf, k):
    ref = torch.log_softmax(hf_logits(hf, prompt + out.token_ids), dim=-1)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        step = ref[len(prompt) - 1 + i]
        top = step.topk(k).indices.tolist()
        assert set(entry) == set(top) | {token}
        assert len(entry) == k + (token not in top)
        for token_id, logprob in entry.items():
            # float32 log_softmax over 49152 logits on both sides: at most 1e-5 apart measured.
            assert logprob == pytest.approx(float(step[token_id]), abs=5e-5)


def test_logprobs_match_transformers_log_softmax(model_dir, hf, make_llm):
    prompt = random_prompt(seed=16, num_tokens=15)
    llm = make_llm(model_dir)
    [out] = llm.generate(prompt, greedy(8, logprobs=5))
    assert all(len(entry) == 5 for entry in out.logprobs)  # the greedy token is the top one
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token] == max(entry.values())
    _check_logprobs(out, prompt, hf, 5)
    [sampled] = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                                     ignore_eos=True, logprobs=5))
    _check_logprobs(sampled, prompt, hf, 5)
    [only] = llm.generate(prompt, greedy(3, logprobs=0))
    assert [list(entry) for entry in only.logprobs] == [[t] for t in only.token_ids]
    [none] = llm.generate(prompt, greedy(3))
    assert none.logprobs is None


# -- requests and blocks ------------------------------------------------------------------------

def test_blocks_are_free_but_cached_after_requests_finish(model_dir, make_llm):
    llm = make_llm(model_dir)
    allocator = llm.engine.allocator
    prompts = [random_prompt(seed=400 + i, num_tokens=21 + 7 * i) for i in range(5)]
    llm.generate(prompts, greedy(10))
    assert allocator.num_used_blocks == 0
    assert allocator.num_free_blocks == allocator.num_blocks == 64
    assert allocator.peek_prefix_blocks(prompts[4]) == 3  # 49 tokens: blocks 0..2 still cached


def test_abort_mid_generation_frees_blocks(model_dir, make_llm):
    llm = make_llm(model_dir)
    engine = llm.engine
    engine.add_request("a", random_prompt(seed=17, num_tokens=40), greedy(30))
    engine.add_request("b", random_prompt(seed=18, num_tokens=10), greedy(30))
    for _ in range(3):
        engine.step()
    assert engine.allocator.num_used_blocks == 3 + 1
    assert engine.abort_request("a") is True
    assert engine.allocator.num_used_blocks == 1
    assert engine.abort_request("a") is False
    assert engine.abort_request("b") is True
    assert engine.allocator.num_used_blocks == 0
    assert not engine.has_unfinished()
    assert engine.step() == []


def test_blocks_reserved_for_a_transferred_prompt_are_adopted_or_freed(model_dir, make_llm):
    """The decode worker's way in: reserve_blocks, add_prefilled or free_blocks, stats()."""
    engine = make_llm(model_dir).engine   # 64 blocks of 16 tokens
    assert engine.reserve_blocks(64 * 16 + 1, 0, transfers_pending=False) is None   # more than the pool
    reserved = engine.reserve_blocks(40, 0, transfers_pending=False)
    assert reserved == [0, 1, 2] and engine.stats().kv_blocks_used == 3
    engine.free_blocks(reserved)
    assert engine.stats().kv_blocks_used == 0
    # Output room for others counts while other work is under way; alone, free blocks are taken.
    assert engine.reserve_blocks(16, 10**6, transfers_pending=True) is None
    prompt = random_prompt(seed=21, num_tokens=17)
    block_ids = engine.reserve_blocks(len(prompt) + 1, 10**6, transfers_pending=False)
    assert block_ids == [3, 4]
    first = engine.add_prefilled("t", prompt, greedy(3), block_ids, first_token=5)
    assert (first.request_id, first.new_token_ids, first.finished) == ("t", [5], False)
    stats = engine.stats()
    assert (stats.num_running, stats.num_running_tokens, stats.kv_blocks_used, stats.kv_usage) == (1, 18, 2, 2 / 64)
    outputs = [first]
    while engine.has_unfinished():
        outputs += engine.step()
    assert [t for out in outputs for t in out.new_token_ids][0] == 5
    assert sum(len(out.new_token_ids) for out in outputs) == 3 and outputs[-1].finish_reason == "length"
    stats = engine.stats()
    assert (stats.num_running, stats.kv_blocks_used, stats.num_generated_tokens) == (0, 0, 3)
    assert engine.num_cached_prefix_tokens(prompt) == 16   # the prompt's first block stays cached


def test_a_prefilled_first_token_that_ends_the_request_comes_back_finished(model_dir, make_llm):
    """add_prefilled answers the first token as the request's first output; an eos there (or
    max_tokens 1) ends it at once and its blocks go back."""
    engine = make_llm(model_dir).engine
    prompt = random_prompt(seed=22, num_tokens=17)
    eos = min(engine.eos_token_ids)
    for request_id, params, first_token, reason in (("eos", SamplingParams(max_tokens=8), eos, "stop"),
                                                     ("one", greedy(1), 5, "length")):
        block_ids = engine.reserve_blocks(len(prompt) + 1, 0, transfers_pending=False)
        out = engine.add_prefilled(request_id, prompt, params, block_ids, first_token=first_token)
        assert (out.request_id, out.new_token_ids, out.finished, out.finish_reason) == (
            request_id, [first_token], True, reason)
        stats = engine.stats()
        assert not engine.has_unfinished() and (stats.num_running, stats.kv_blocks_used) == (0, 0)


def test_a_bad_prompt_leaves_no_request_behind(model_dir, make_llm):
    llm = make_llm(model_dir)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([random_prompt(seed=19, num_tokens=10), []], greedy(4))
    assert not llm.engine.has_unfinished()
    assert llm.engine.allocator.num_used_blocks == 0
    [out] = llm.generate(random_prompt(seed=19, num_tokens=10), greedy(4))
    assert len(out.token_ids) == 4


def test_text_prompts_and_chat_are_tokenized(model_dir, make_llm, smollm2_tokenizer):
    llm = make_llm(model_dir)
    [out] = llm.generate("Hello world", greedy(3))
    assert out.prompt_token_ids == smollm2_tokenizer.encode("Hello world")
    assert out.text == smollm2_tokenizer.decode(out.token_ids)
    conversation = [{"role": "user", "content": "Hi"}]
    [chat] = llm.chat([conversation], greedy(3))
    assert chat.prompt_token_ids == smollm2_tokenizer.encode_chat(conversation)
    assert len(chat.token_ids) == 3
