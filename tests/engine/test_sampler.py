"""Unit tests for engine.sampler: penalties, filters, seeding and raw logprobs on CPU."""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import SamplingParams
from engine.sampler import (
    Sampler,
    SamplingRequest,
    apply_penalties,
    apply_top_k_top_p_min_p,
    make_generator,
)

NEG_INF = float("-inf")


def req(prompt=(), output=(), seed=None, **params) -> SamplingRequest:
    sp = SamplingParams(seed=seed, **params)
    return SamplingRequest(sp, list(prompt), list(output), make_generator(seed, "cpu"))


def random_logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


# ---- greedy ---------------------------------------------------------------------------------

def test_greedy_is_argmax_on_the_fast_path():
    logits = random_logits(4, 50)
    out = Sampler()(logits, [req(temperature=0.0) for _ in range(4)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_ties_pick_lowest_id():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0, 5.0, -1.0]])
    assert Sampler()(logits, [req(temperature=0.0)]).token_ids == [1]


def test_greedy_with_penalties_takes_argmax_of_penalized_logits():
    logits = torch.tensor([[1.0, 3.0, 2.5, -1.0, 0.5, 2.0]])
    sampler = Sampler()
    assert sampler(logits, [req(temperature=0.0)]).token_ids == [1]
    # 3.0 / 2 = 1.5 < 2.5: token 2 wins.
    assert sampler(logits, [req(output=[1], temperature=0.0, repetition_penalty=2.0)]).token_ids == [2]
    # Token 1: 3.0 - 0.6 - 2 * 0.5 = 1.4; token 2: 2.5 - 0.6 - 0.5 = 1.4; token 5 (2.0) wins.
    out = sampler(logits, [req(output=[1, 1, 2], temperature=0.0,
                               presence_penalty=0.6, frequency_penalty=0.5)])
    assert out.token_ids == [5]


def test_input_logits_are_not_modified():
    logits = random_logits(2, 10)
    before = logits.clone()
    Sampler()(logits, [req(output=[1, 2], temperature=0.0, repetition_penalty=1.5),
                       req(output=[3], temperature=0.7, top_k=3, frequency_penalty=1.0,
                           logprobs=2)])
    assert torch.equal(logits, before)


# ---- penalties ------------------------------------------------------------------------------

BASE = [2.0, -1.0, 0.5, 4.0, -2.0, 1.0]


def test_repetition_penalty_over_prompt_and_output():
    logits = torch.tensor([BASE])
    out = apply_penalties(logits, [req(prompt=[0, 1], output=[1, 3], repetition_penalty=2.0)])
    # Seen {0, 1, 3}: positive divided, negative multiplied.
    assert out.tolist() == [[1.0, -2.0, 0.5, 2.0, -2.0, 1.0]]


def test_presence_and_frequency_penalty_over_output_only():
    logits = torch.tensor([BASE])
    out = apply_penalties(
        logits, [req(prompt=[0, 5], output=[2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25)])
    # Token 2: count 2 -> 0.5 - 0.5 - 0.5; token 3: count 1 -> 4 - 0.5 - 0.25; prompt untouched.
    assert out.tolist() == [[2.0, -1.0, -0.5, 3.25, -2.0, 1.0]]


def test_penalties_combine_in_order_and_stay_per_row():
    logits = torch.tensor([BASE, BASE, BASE])
    requests = [
        req(prompt=[4], output=[3, 3], repetition_penalty=2.0, frequency_penalty=1.0),
        req(prompt=[0], output=[3]),                              # no penalties
        req(prompt=[0], output=[], presence_penalty=2.0),         # no output yet
    ]
    out = apply_penalties(logits, requests)
    # Row 0: token 3 -> 4 / 2 - 1 * 2 = 0; token 4 (prompt, negative) -> -2 * 2.
    assert out.tolist() == [[2.0, -1.0, 0.5, 0.0, -4.0, 1.0], BASE, BASE]


def test_negative_presence_penalty_raises_logits():
    out = apply_penalties(torch.tensor([BASE]), [req(output=[1], presence_penalty=-1.5)])
    assert out.tolist() == [[2.0, 0.5, 0.5, 4.0, -2.0, 1.0]]


def test_no_penalties_returns_logits_unchanged():
    logits = torch.tensor([BASE])
    assert apply_penalties(logits, [req(prompt=[0], output=[1])]) is logits


# ---- top-k / top-p / min-p ------------------------------------------------------------------

# Descending order of probability is token 1, 3, 4, 0, 2; kept() lists ids ascending.
PROBS = [0.1, 0.4, 0.05, 0.3, 0.15]


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [[i for i, x in enumerate(row) if x != NEG_INF] for row in logits.tolist()]


def filter_rows(top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    num_rows = len(next(x for x in (top_k, top_p, min_p) if x is not None))
    logits = torch.log(torch.tensor([PROBS] * num_rows))
    out = apply_top_k_top_p_min_p(
        logits,
        torch.tensor(top_k, dtype=torch.long) if top_k is not None else None,
        torch.tensor(top_p, dtype=torch.float32) if top_p is not None else None,
        torch.tensor(min_p, dtype=torch.float32) if min_p is not None else None,
    )
    # Kept entries keep their exact value.
    finite = out != NEG_INF
    assert torch.equal(out[finite], logits[finite])
    return out


def test_top_k_mask():
    out = filter_rows(top_k=[1, 2, 4, 0, -1, 5, 99])
    assert kept(out) == [[1], [1, 3], [0, 1, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4],
                         [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]


def test_top_k_keeps_ties_with_the_kth_value():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    out = apply_top_k_top_p_min_p(logits, torch.tensor([2]), None, None)
    assert kept(out) == [[1, 2, 3]]


def test_top_p_mask():
    # Cumulative mass in order 1, 3, 4, 0, 2: 0.4, 0.7, 0.85, 0.95, 1.0.
    out = filter_rows(top_p=[1e-6, 0.35, 0.6, 0.75, 0.9, 0.97, 1.0])
    assert kept(out) == [[1], [1], [1, 3], [1, 3, 4], [0, 1, 3, 4], [0, 1, 2, 3, 4],
                         [0, 1, 2, 3, 4]]


def test_top_p_applies_to_the_top_k_distribution():
    # After top-3 the mass is 0.4/0.85, 0.3/0.85, 0.15/0.85: cumulative 0.47, 0.82, 1.0,
    # so token 4 goes; without top-k the cumulative 0.4, 0.7, 0.85 keeps it.
    out = filter_rows(top_k=[3, 0], top_p=[0.8, 0.8])
    assert kept(out) == [[1, 3], [1, 3, 4]]


def test_min_p_mask():
    # Thresholds relative to max 0.4: 0.5 -> 0.2, 0.3 -> 0.12, 0.2 -> 0.08.
    out = filter_rows(min_p=[1.0, 0.5, 0.3, 0.2, 0.0])
    assert kept(out) == [[1], [1, 3], [1, 3, 4], [0, 1, 3, 4], [0, 1, 2, 3, 4]]


def test_filters_per_row_in_one_batch():
    out = filter_rows(top_k=[2, 0, 0], top_p=[1.0, 0.6, 1.0], min_p=[0.0, 0.0, 0.3])
    assert kept(out) == [[1, 3], [1, 3], [1, 3, 4]]


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_leave_only_the_top_token_sample_argmax(params):
    logits = random_logits(8, 100, seed=3)
    sampler = Sampler()
    for _ in range(20):
        out = sampler(logits, [req(temperature=1.5, **params) for _ in range(8)])
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_sampler_never_picks_a_filtered_token():
    logits = torch.log(torch.tensor([PROBS] * 2000))
    requests = [req(top_k=3), req(top_p=0.6), req(min_p=0.3), req(top_k=2, min_p=0.9)] * 500
    out = Sampler(seed=7)(logits, requests)
    allowed = [{1, 3, 4}, {1, 3}, {1, 3, 4}, {1}]
    assert all(tok in allowed[i % 4] for i, tok in enumerate(out.token_ids))
    # Each row's allowed set is actually reached, not collapsed to argmax.
    assert {t for i, t in enumerate(out.token_ids) if i % 4 == 0} == {1, 3, 4}


# ---- seeds and the sampled distribution ----------------------------------------------------

def draw(sampler: Sampler, logits_row: torch.Tensor, requests: list[SamplingRequest],
         row: int, steps: int) -> list[int]:
    logits = logits_row.expand(len(requests), -1).contiguous()
    return [sampler(logits, requests).token_ids[row] for _ in range(steps)]


def test_same_seed_gives_same_tokens_whatever_the_batch():
    logits_row = random_logits(1, 64, seed=1)[0] * 0.3
    alone = draw(Sampler(seed=1), logits_row, [req(seed=1234)], row=0, steps=30)
    companions = [req(seed=99), req(), req(seed=1234), req(temperature=0.0), req(top_k=5)]
    in_batch = draw(Sampler(seed=2), logits_row, companions, row=2, steps=30)
    assert alone == in_batch
    assert len(set(alone)) > 5  # really sampling


def test_different_seeds_differ():
    logits_row = torch.zeros(64)
    a = draw(Sampler(), logits_row, [req(seed=1), req(seed=2)], row=0, steps=50)
    b = draw(Sampler(), logits_row, [req(seed=1), req(seed=2)], row=1, steps=50)
    assert a != b
    assert sum(x == y for x, y in zip(a, b)) < 10


def test_shared_generator_is_deterministic_per_sampler_seed():
    logits = random_logits(16, 32, seed=2)
    requests = [req() for _ in range(16)]
    assert Sampler(seed=5)(logits, requests).token_ids == Sampler(seed=5)(logits, requests).token_ids
    assert Sampler(seed=5)(logits, requests).token_ids != Sampler(seed=6)(logits, requests).token_ids


def empirical(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab_size).float() / len(token_ids)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_shared_generator_matches_softmax(temperature):
    logits_row = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 1.5, -0.5])
    num_draws = 20_000
    out = Sampler(seed=11)(logits_row.expand(num_draws, -1).contiguous(),
                           [req(temperature=temperature)] * num_draws)
    expected = torch.softmax(logits_row / temperature, dim=-1)
    assert (empirical(out.token_ids, 8) - expected).abs().max().item() < 0.02


def test_seeded_generator_matches_softmax():
    logits_row = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 1.5, -0.5])
    num_draws = 20_000
    generator = make_generator(42, "cpu")
    requests = [SamplingRequest(SamplingParams(seed=42), [], [], generator)] * num_draws
    out = Sampler()(logits_row.expand(num_draws, -1).contiguous(), requests)
    expected = torch.softmax(logits_row, dim=-1)
    assert (empirical(out.token_ids, 8) - expected).abs().max().item() < 0.02


def test_top_k_distribution_is_renormalized():
    logits_row = torch.log(torch.tensor(PROBS))
    num_draws = 20_000
    out = Sampler(seed=3)(logits_row.expand(num_draws, -1).contiguous(),
                          [req(top_k=3)] * num_draws)
    expected = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15]) / 0.85
    assert (empirical(out.token_ids, 5) - expected).abs().max().item() < 0.02


# ---- logprobs -------------------------------------------------------------------------------

def test_logprobs_come_from_raw_logits():
    logits = random_logits(4, 50, seed=4)
    requests = [
        req(temperature=0.5, logprobs=5, output=[7], repetition_penalty=1.8, seed=3),
        req(temperature=0.0, logprobs=0),
        req(temperature=1.0),
        req(temperature=0.0, logprobs=20, output=[1, 2], frequency_penalty=2.0),
    ]
    out = Sampler()(logits, requests)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == [raw[i, t].item() for i, t in enumerate(out.token_ids)]
    for row, k in [(0, 5), (3, 20)]:
        values, ids = raw[row].sort(descending=True, stable=True)
        assert out.top_logprobs[row] == list(zip(ids[:k].tolist(), values[:k].tolist()))
    assert len(out.top_logprobs[3]) == 20
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []


def test_top_logprobs_ties_by_lower_id():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0]])
    out = Sampler()(logits, [req(temperature=0.0, logprobs=4)])
    assert [tok for tok, _ in out.top_logprobs[0]] == [1, 3, 2, 4]
    lp = out.top_logprobs[0][0][1]
    assert math.isclose(lp, 2.0 - math.log(2 * math.e**2 + 2 * math.e + 1), rel_tol=1e-6)


def test_non_float32_logits_are_upcast():
    logits = random_logits(2, 30, seed=5).to(torch.bfloat16)
    out = Sampler()(logits, [req(temperature=0.0, logprobs=1), req(temperature=0.0)])
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [raw[i, t].item() for i, t in enumerate(out.token_ids)]


# ---- mixed batches --------------------------------------------------------------------------

def test_mixed_batch_shapes_and_row_independence():
    logits = random_logits(5, 40, seed=6)
    requests = [
        req(temperature=0.0),
        req(temperature=0.8, seed=77, top_p=0.9),
        req(temperature=0.0, logprobs=3),
        req(temperature=1.2, top_k=10),
        req(temperature=0.0, output=[int(logits[4].argmax())], repetition_penalty=100.0),
    ]
    out = Sampler()(logits, requests)
    assert len(out.token_ids) == 5 and len(out.logprobs) == 5 and len(out.top_logprobs) == 5
    assert [len(pairs) for pairs in out.top_logprobs] == [0, 0, 3, 0, 0]
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())
    # Row 4's argmax is penalized away: the runner-up wins.
    assert out.token_ids[4] == int(logits[4].sort(descending=True).indices[1])
    # The seeded row gives the same token alone as in the mixed batch.
    alone = Sampler()(logits[1:2], [req(temperature=0.8, seed=77, top_p=0.9)])
    assert alone.token_ids == [out.token_ids[1]]


def test_rejects_mismatched_batch():
    with pytest.raises(ValueError, match="B=2"):
        Sampler()(torch.zeros(3, 5), [req(), req()])


def test_inverse_cdf_never_picks_a_zero_probability_token_at_the_edges(monkeypatch):
    """u = 0 and u just below 1 land on the first and the last token with probability > 0."""
    from engine.sampler import Sampler, SamplingRequest

    logits = torch.full((2, 8), float("-inf"))
    logits[:, 2] = logits[:, 5] = 0.0           # tokens 0, 1, 3, 4, 6, 7 have probability 0
    requests = [SamplingRequest(SamplingParams(temperature=1.0), [1], []) for _ in range(2)]
    edges = torch.tensor([[0.0], [1.0 - 2.0 ** -24]])
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, generator=None: self.copy_(edges))
    assert Sampler()(logits, requests).token_ids == [2, 5]


@pytest.mark.parametrize("knobs", [
    {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.3, "top_k": 50},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}, {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 0.6, "top_p": 0.5}, {"temperature": 1.0, "top_k": 1},
])
@pytest.mark.parametrize("spread", [3.0, 0.05])   # peaked rows, and rows near flat (top-p then sorts them all)
def test_the_c_sampler_draws_what_the_torch_rule_draws(knobs, spread):
    """engine/csrc/sampling.c against sample_by_inverse_cdf, the same uniforms: the same token in
    every row (they may differ only where rounding puts u or a top-p cut exactly on a boundary)."""
    from engine.sampler import _native, sample_by_inverse_cdf

    native = _native()
    if native is None:
        pytest.skip("the C sampler did not build here")
    g = torch.Generator().manual_seed(int(spread * 100) + len(knobs))
    logits = torch.randn(96, 3001, generator=g) * spread
    logits[:, 17] = float("-inf")             # a masked token in every row
    logits[::5, :2000] = float("-inf")        # rows that keep only their last 1001 tokens
    params = [SamplingParams(**knobs) for _ in range(96)]
    uniform = torch.rand(96, 1, generator=g)
    uniform[0, 0], uniform[1, 0] = 0.0, 1.0 - 2.0 ** -24
    got = native(logits, params, uniform)
    assert got is not None
    assert got.tolist() == sample_by_inverse_cdf(logits, params, uniform).tolist()
    assert not (got == 17).any()


def test_the_c_sampler_leaves_rows_with_nothing_to_draw_to_the_torch_path():
    from engine.sampler import _native

    native = _native()
    if native is None:
        pytest.skip("the C sampler did not build here")
    logits = torch.zeros(2, 64)
    logits[1] = float("-inf")
    assert native(logits, [SamplingParams(temperature=1.0)] * 2, torch.full((2, 1), 0.5)) is None
