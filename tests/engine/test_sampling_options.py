"""Sampling options end to end through the in-process engine (engine/llm.py) on the tiny model.

The router tests check that seed, top_k, min_p and the penalties reach the workers; these check
that the engine honours them: a seed reproduces a draw wherever the request runs, and each
filter or penalty moves the output the way its definition says. Raw logprobs (computed before
penalties and filters, at temperature 1 equal to the sampling distribution) are the witness
for the filters.
"""
from __future__ import annotations

import math

import pytest

from engine.config import SamplingParams
from tests.models import greedy, random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_TOKENS = 48


def sampled(max_tokens: int = NUM_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True, **kwargs})


def num_repeats(token_ids: list[int]) -> int:
    """Tokens that already occurred earlier in the output."""
    return len(token_ids) - len(set(token_ids))


@pytest.fixture
def llm(tiny_model_dir, make_llm):
    return make_llm(tiny_model_dir("llama"))


@pytest.fixture
def prompt() -> list[int]:
    return random_prompt(seed=31, num_tokens=12)


def test_a_seed_gives_the_same_tokens_wherever_the_request_runs(tiny_model_dir, make_llm, llm, prompt):
    params = sampled(seed=1234)
    [first] = llm.generate(prompt, params)
    # The engine's shared generator has moved on since; a seeded request must not use it.
    llm.generate([prompt, prompt], [sampled(), sampled()])
    [again] = llm.generate(prompt, params)
    batch = llm.generate([random_prompt(seed=32, num_tokens=20), prompt], [sampled(), params])
    [fresh] = make_llm(tiny_model_dir("llama")).generate(prompt, params)
    assert again.token_ids == first.token_ids
    assert batch[1].token_ids == first.token_ids
    assert fresh.token_ids == first.token_ids
    assert len(first.token_ids) == NUM_TOKENS


def test_different_seeds_draw_different_tokens(llm, prompt):
    outs = llm.generate([prompt] * 4, [sampled(seed=s) for s in (1, 2, 3, 4)])
    assert len({tuple(o.token_ids) for o in outs}) == 4
    assert all(o.token_ids != llm.generate(prompt, greedy(NUM_TOKENS))[0].token_ids for o in outs)


def test_top_k_1_and_min_p_1_are_greedy(llm, prompt):
    [expected] = llm.generate(prompt, greedy(NUM_TOKENS))
    outs = llm.generate([prompt] * 4, [sampled(top_k=1, seed=5), sampled(top_k=1, seed=6),
                                       sampled(min_p=1.0, seed=7), sampled(min_p=1.0, temperature=2.0, seed=8)])
    assert [o.token_ids for o in outs] == [expected.token_ids] * 4


def test_top_k_draws_only_from_the_k_most_likely_tokens(llm, prompt):
    k = 3
    [unfiltered] = llm.generate(prompt, sampled(seed=9, logprobs=k))
    [out] = llm.generate(prompt, sampled(top_k=k, seed=9, logprobs=k))
    # logprobs hold the sampled token plus the top k, from the raw logits.
    outside = [i for i, (token, top) in enumerate(zip(unfiltered.token_ids, unfiltered.logprobs))
               if token not in sorted(top, key=top.get, reverse=True)[:k]]
    assert outside, "without top_k the draw leaves the top 3 at times (else this test shows nothing)"
    assert len(out.logprobs) == len(out.token_ids) == NUM_TOKENS
    for token, top in zip(out.token_ids, out.logprobs):
        assert token in sorted(top, key=top.get, reverse=True)[:k]


def test_min_p_draws_only_tokens_at_least_that_likely_relative_to_the_best(llm, prompt):
    min_p = 0.3
    [unfiltered] = llm.generate(prompt, sampled(seed=10, logprobs=1))
    [out] = llm.generate(prompt, sampled(min_p=min_p, seed=10, logprobs=1))

    def relative(token: int, logprobs: dict[int, float]) -> float:
        return math.exp(logprobs[token] - max(logprobs.values()))

    assert min(relative(t, lp) for t, lp in zip(unfiltered.token_ids, unfiltered.logprobs)) < min_p
    assert len(out.token_ids) == NUM_TOKENS
    assert all(relative(t, lp) >= min_p - 1e-6 for t, lp in zip(out.token_ids, out.logprobs))


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 2.0}, {"presence_penalty": 2.0},
                                     {"frequency_penalty": 2.0}], ids=lambda p: next(iter(p)))
def test_penalties_reduce_repeats(llm, prompt, penalty):
    # 200 tokens: measured, plain greedy repeats 8 of them and each penalty at 2.0 none.
    [plain] = llm.generate(prompt, greedy(200))
    [penalized] = llm.generate(prompt, greedy(200, **penalty))
    assert num_repeats(plain.token_ids) >= 5, "plain greedy repeats itself (else this test shows nothing)"
    assert num_repeats(penalized.token_ids) <= num_repeats(plain.token_ids) // 4
