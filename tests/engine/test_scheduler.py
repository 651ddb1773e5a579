"""Tests for engine/scheduler.py: chunked prefill, decode block growth, retraction, admission
policy and abort, on real Sequences and a real BlockAllocator with no model at all.

``step`` plays the engine's part (llm_engine.LLMEngine._postprocess) without sampling: every
computed chunk advances ``num_computed_tokens`` and registers full blocks, and every sequence
that reached its last token gets one more (fake) output token.
"""
from __future__ import annotations

import logging

import pytest

from engine.block_manager import BlockAllocator
from engine.config import SamplingParams, SchedulerConfig
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus

NEXT_TOKEN = 7


def make_scheduler(num_blocks: int, block_size: int, max_model_len: int = 256, **config) -> Scheduler:
    config.setdefault("chunked_prefill_size", 2048)
    return Scheduler(SchedulerConfig(**config), BlockAllocator(num_blocks, block_size), max_model_len)


def make_seq(request_id: str, prompt: list[int] | int, max_tokens: int = 16, arrival_s: float = 0.0) -> Sequence:
    tokens = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else prompt
    return Sequence(request_id, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                    arrival_s=arrival_s)


def step(scheduler: Scheduler) -> ScheduledBatch:
    batch = scheduler.schedule()
    sampling = [s for s, n in batch.prefills if s.num_computed_tokens + n == s.num_tokens] + batch.decodes
    for seq, num_new in batch.prefills:
        seq.num_computed_tokens += num_new
        scheduler.cache_computed_blocks(seq)
    for seq in batch.decodes:
        seq.num_computed_tokens += 1
        scheduler.cache_computed_blocks(seq)
    for seq in sampling:
        seq.output_token_ids.append(NEXT_TOKEN)
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            scheduler.finish(seq, "length")
    return batch


def running_seq(scheduler: Scheduler, request_id: str, prompt_len: int, num_output: int,
                arrival_s: float = 0.0) -> Sequence:
    """A sequence mid-decode: every token but the last sampled one is computed and cached."""
    seq = make_seq(request_id, prompt_len, max_tokens=100, arrival_s=arrival_s)
    seq.output_token_ids = [NEXT_TOKEN] * num_output
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.block_ids = scheduler.allocator.allocate(-(-seq.num_computed_tokens // scheduler.block_size))
    seq.status = SequenceStatus.RUNNING
    scheduler.running.append(seq)
    return seq


# -- chunked prefill ----------------------------------------------------------------------------

def test_a_steps_budget_counts_its_decodes_and_leaves_prefill_at_least_a_quarter():
    """chunked_prefill_size bounds a step's tokens, decodes included (a busy step stays at the row
    count it was tuned for); with more decodes than that, prefill still gets a quarter."""
    scheduler = make_scheduler(num_blocks=200, block_size=16, chunked_prefill_size=64)
    for i in range(10):
        running_seq(scheduler, f"d{i}", prompt_len=20, num_output=1)
    scheduler.add(make_seq("long", 300))
    batch = step(scheduler)
    assert len(batch.decodes) == 10 and batch.prefills == [(scheduler.running[-1], 54)]
    for i in range(10, 70):
        running_seq(scheduler, f"d{i}", prompt_len=20, num_output=1)
    batch = step(scheduler)
    assert len(batch.decodes) == 70 and [n for _, n in batch.prefills] == [16]   # 64 // 4



def test_chunked_prefill_splits_a_40_token_prompt_into_8_token_chunks():
    scheduler = make_scheduler(num_blocks=8, block_size=16, chunked_prefill_size=8)
    seq = make_seq("a", 40)
    scheduler.add(seq)
    seen = []
    for _ in range(6):
        before = seq.num_computed_tokens
        batch = step(scheduler)
        seen.append((before, [(s.request_id, n) for s, n in batch.prefills],
                     [s.request_id for s in batch.decodes], list(seq.block_ids), seq.num_cached_blocks))
    # Only blocks whose every token is computed enter the prefix cache.
    assert seen == [
        (0, [("a", 8)], [], [0], 0),
        (8, [("a", 8)], [], [0], 1),
        (16, [("a", 8)], [], [0, 1], 1),
        (24, [("a", 8)], [], [0, 1], 2),
        (32, [("a", 8)], [], [0, 1, 2], 2),   # reaches the last prompt token: samples
        (40, [], ["a"], [0, 1, 2], 2),        # the first decode, position 40
    ]
    assert seq.output_token_ids == [NEXT_TOKEN, NEXT_TOKEN]
    assert scheduler.allocator.block_hash(1) is not None and scheduler.allocator.block_hash(2) is None


def test_chunk_budget_is_shared_in_arrival_order():
    scheduler = make_scheduler(num_blocks=16, block_size=4, chunked_prefill_size=8)
    for rid, n in [("a", 5), ("b", 6), ("c", 2)]:
        scheduler.add(make_seq(rid, n))
    batch = step(scheduler)
    assert [(s.request_id, n) for s, n in batch.prefills] == [("a", 5), ("b", 3)]
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    batch = step(scheduler)
    # a decodes; b finishes its prompt; c is admitted with what is left of the budget.
    assert [s.request_id for s in batch.decodes] == ["a"]
    assert [(s.request_id, n) for s, n in batch.prefills] == [("b", 3), ("c", 2)]
    assert [s.block_ids for s in scheduler.running] == [[0, 1], [2, 3], [4]]


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    for rid in "abc":
        scheduler.add(make_seq(rid, 3, max_tokens=2))
    assert [s.request_id for s, _ in step(scheduler).prefills] == ["a", "b"]
    assert [s.request_id for s, _ in step(scheduler).prefills] == []   # a and b finish here
    assert [s.request_id for s, _ in step(scheduler).prefills] == ["c"]
    assert scheduler.allocator.num_used_blocks == 1


# -- decode -------------------------------------------------------------------------------------

def test_decode_grows_a_block_exactly_at_block_boundaries():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    a, b = make_seq("a", 6, max_tokens=20), make_seq("b", 4, max_tokens=20)
    scheduler.add(a)
    scheduler.add(b)
    tables = []
    for _ in range(8):
        step(scheduler)
        tables.append((list(a.block_ids), list(b.block_ids)))
    # a computes positions 0..5, then 6, 7, 8 (new block), ...; b: 0..3, then 4 (new block), ...
    assert tables == [
        ([0, 1], [2]),
        ([0, 1], [2, 3]),
        ([0, 1], [2, 3]),
        ([0, 1, 4], [2, 3]),
        ([0, 1, 4], [2, 3]),
        ([0, 1, 4], [2, 3, 5]),
        ([0, 1, 4], [2, 3, 5]),
        ([0, 1, 4, 6], [2, 3, 5]),
    ]
    assert (a.num_tokens, a.num_computed_tokens) == (14, 13)


# -- retraction ---------------------------------------------------------------------------------

def test_retraction_picks_the_request_with_the_least_output(caplog):
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    # Each has 9 tokens, 8 computed in 2 blocks, and needs a 3rd block for position 8.
    a = running_seq(scheduler, "a", prompt_len=5, num_output=4)
    b = running_seq(scheduler, "b", prompt_len=7, num_output=2)
    c = running_seq(scheduler, "c", prompt_len=6, num_output=3)
    assert scheduler.allocator.num_free_blocks == 2
    scheduler.new_token_ratio = 0.2  # as if decayed over many steps
    with caplog.at_level(logging.WARNING, logger="engine.scheduler"):
        batch = scheduler.schedule()
    assert batch.decodes == [a, c] and batch.prefills == []
    assert list(scheduler.waiting) == [b] and scheduler.running == [a, c]
    assert (b.status, b.block_ids, b.num_computed_tokens, b.num_retractions) == (SequenceStatus.WAITING, [], 0, 1)
    assert b.output_token_ids == [NEXT_TOKEN] * 2  # kept, to be recomputed
    assert scheduler.num_retracted_total == 1
    assert a.block_ids == [0, 1, 6] and c.block_ids == [4, 5, 7]
    assert scheduler.allocator.num_free_blocks == 2  # b's two blocks
    # Raised to (decoded + 20 steps x running) / (max_new + 1) of a and c: (7 + 40) / 201.
    assert scheduler.new_token_ratio == pytest.approx(47 / 201, abs=2e-3)  # minus one step's decay
    assert "decode out of memory happened, #retracted_reqs: 1, #new_token_ratio: 0.2000 -> 0.2338" in caplog.text


def test_retraction_tie_goes_to_the_latest_arrival():
    scheduler = make_scheduler(num_blocks=5, block_size=4)
    early = running_seq(scheduler, "early", prompt_len=6, num_output=3, arrival_s=1.0)
    late = running_seq(scheduler, "late", prompt_len=6, num_output=3, arrival_s=2.0)
    assert scheduler.allocator.num_free_blocks == 1
    batch = scheduler.schedule()
    assert batch.decodes == [early] and list(scheduler.waiting) == [late]


def test_retracted_request_is_recomputed_and_finishes():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=32)
    seqs = [make_seq(rid, 6, max_tokens=12) for rid in "ab"]
    for seq in seqs:
        scheduler.add(seq)
    steps = 0
    while scheduler.has_unfinished:
        step(scheduler)
        steps += 1
        assert steps < 100
    assert scheduler.num_retracted_total >= 1
    assert all(s.finish_reason == "length" and len(s.output_token_ids) == 12 for s in seqs)
    assert scheduler.allocator.num_used_blocks == 0


# -- admission ----------------------------------------------------------------------------------

def _cache_prefix(allocator: BlockAllocator, token_ids: list[int]) -> list[int]:
    """Leave ``token_ids`` in the prefix cache as a finished request would: free but cached."""
    block_ids = allocator.allocate(len(token_ids) // allocator.block_size)
    allocator.cache_full_blocks(block_ids, token_ids, 0)
    allocator.free(block_ids[::-1])
    return block_ids


@pytest.mark.parametrize("policy, order", [("lpm", ["z", "y", "x"]), ("fcfs", ["x", "y", "z"])])
def test_admission_order_by_policy(policy, order):
    scheduler = make_scheduler(num_blocks=32, block_size=4, schedule_policy=policy)
    prefix = list(range(1, 13))
    assert _cache_prefix(scheduler.allocator, prefix) == [0, 1, 2]
    x = make_seq("x", [500 + i for i in range(9)])             # no cached block
    y = make_seq("y", prefix[:4] + [600 + i for i in range(5)])  # 1 cached block
    z = make_seq("z", prefix[:8] + [700])                        # 2 cached blocks
    for seq in (x, y, z):
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert [s.request_id for s, _ in batch.prefills] == order
    assert {s.request_id: n for s, n in batch.prefills} == {"x": 9, "y": 5, "z": 1}
    assert (x.num_computed_tokens, y.num_computed_tokens, z.num_computed_tokens) == (0, 4, 8)
    assert (y.num_prefix_hit_tokens, z.num_prefix_hit_tokens) == (4, 8)
    assert y.block_ids[:1] == [0] and z.block_ids[:2] == [0, 1]
    assert scheduler.allocator.ref_count(0) == 2 and scheduler.allocator.ref_count(1) == 1
    if policy == "lpm":
        assert (z.block_ids, y.block_ids, x.block_ids) == ([0, 1, 3], [0, 4, 5], [6, 7, 8])


@pytest.mark.parametrize("prompt_len, admitted", [(16, True), (20, False)])
def test_admission_keeps_room_for_running_requests_outputs(prompt_len, admitted):
    scheduler = make_scheduler(num_blocks=10, block_size=4)
    scheduler.add(make_seq("a", 4, max_tokens=20))
    step(scheduler)
    # a grows to 2 blocks for this step's decode and is expected to need
    # int(19 remaining x 0.699) // 4 = 3 more; 8 are free. b needs its prompt + 1 token:
    # 16 -> 5 blocks fits (5 + 3 <= 8), 20 -> 6 blocks does not.
    scheduler.add(make_seq("b", prompt_len))
    batch = scheduler.schedule()
    assert [s.request_id for s, _ in batch.prefills] == (["b"] if admitted else [])
    assert len(scheduler.waiting) == (0 if admitted else 1)


# -- abort --------------------------------------------------------------------------------------

def test_abort_frees_blocks_of_running_and_waiting_requests():
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    allocator = scheduler.allocator
    shared = list(range(1, 9))
    a, b, c = make_seq("a", shared + [20, 21]), make_seq("b", shared + [30]), make_seq("c", 5)
    scheduler.add(a)
    step(scheduler)
    scheduler.add(b)   # hits a's two full blocks
    scheduler.add(c)   # waits: max_num_seqs=2
    step(scheduler)
    assert (a.block_ids, b.block_ids, list(scheduler.waiting)) == ([0, 1, 2], [0, 1, 3], [c])
    assert allocator.num_used_blocks == 4 and allocator.ref_count(0) == 2
    assert scheduler.abort("c") is c and c.finish_reason == "abort"
    assert allocator.num_used_blocks == 4
    assert scheduler.abort("a") is a and a.block_ids == [] and a.finish_reason == "abort"
    assert allocator.num_used_blocks == 3 and allocator.ref_count(0) == 1  # b keeps the shared blocks
    assert scheduler.abort("nope") is None
    assert scheduler.abort("b") is b
    assert allocator.num_used_blocks == 0
    assert not scheduler.has_unfinished
    assert step(scheduler).is_empty
