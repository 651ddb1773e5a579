"""Routing policies on hand-built WorkerStates: exact choices for given loads and prompts."""
from __future__ import annotations

import pytest

from protos.tandem.v1 import worker_pb2
from router.policies import make_policy
from router.policies.cache_aware import CacheAware, chunk_hashes
from router.registry import WorkerState


def worker(address: str, load: int = 0, kv_used: int = 0) -> WorkerState:
    w = WorkerState("prefill", address, channel=None, stub=None, healthy=True, num_inflight=load)
    w.stats = worker_pb2.StatsResponse(kv_blocks_used=kv_used, kv_blocks_total=100)
    return w


def test_round_robin_cycles_in_address_order():
    policy = make_policy("round_robin")
    workers = [worker("b:1"), worker("a:1"), worker("c:1")]
    assert [policy.choose(workers, [1]).address for _ in range(4)] == ["a:1", "b:1", "c:1", "a:1"]


def test_least_load_prefers_fewer_inflight_then_lower_kv_usage():
    policy = make_policy("least_load")
    assert policy.choose([worker("a:1", 3), worker("b:1", 1), worker("c:1", 2)], [1]).address == "b:1"
    assert policy.choose([worker("a:1", 1, kv_used=50), worker("b:1", 1, kv_used=10)], [1]).address == "b:1"
    assert policy.choose([worker("b:1", 1), worker("a:1", 1)], [1]).address == "a:1"


def test_power_of_two_never_picks_the_most_loaded_of_three():
    policy = make_policy("power_of_two", seed=7)
    workers = [worker("a:1", 0), worker("b:1", 5), worker("c:1", 9)]
    picks = {policy.choose(workers, [1]).address for _ in range(50)}
    assert "c:1" not in picks and picks <= {"a:1", "b:1"}
    assert policy.choose([worker("only:1", 9)], [1]).address == "only:1"


def test_chunk_hashes_chain_over_full_chunks_only():
    a = chunk_hashes(list(range(40)), 16)
    b = chunk_hashes(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a == b
    assert chunk_hashes([5] + list(range(1, 32)), 16)[1] != a[1]  # a changed first chunk changes every hash after


def test_cache_aware_sends_a_shared_prefix_back_to_the_same_worker():
    policy = CacheAware(chunk_tokens=4, cache_threshold=0.5)
    workers = [worker("a:1"), worker("b:1")]
    first = policy.choose(workers, list(range(16)))
    other = policy.choose(workers, list(range(100, 116)))
    assert other.address != first.address  # no match, equal loads: the smaller (empty) tree wins
    assert policy.choose(workers, list(range(16)) + [7, 7, 7, 7]).address == first.address
    assert policy.choose(workers, list(range(100, 116)) + [1]).address == other.address


def test_cache_aware_sends_a_miss_to_the_least_loaded_worker_not_the_emptiest_tree():
    # A replica just added has an empty tree; prompts that share no prefix must not all go to it
    # while the old replica idles (it did: 1 in flight there against 0 kept choosing the new one).
    policy = CacheAware(chunk_tokens=4)
    old, new = worker("old:1", load=0), worker("new:1", load=0)
    for i in range(8):
        policy.choose([old], list(range(100 * i, 100 * i + 16)))
    picks = []
    for i in range(8):
        chosen = policy.choose([old, new], list(range(10_000 + 100 * i, 10_000 + 100 * i + 16)))
        chosen.num_inflight += 1       # the prompt is in flight there now
        picks.append(chosen.address)
    assert picks.count("old:1") == picks.count("new:1") == 4, picks


def test_cache_aware_falls_back_to_least_load_when_imbalanced():
    policy = CacheAware(chunk_tokens=4, balance_abs_threshold=4, balance_rel_threshold=1.5)
    busy, idle = worker("a:1", load=0), worker("b:1", load=0)
    assert policy.choose([busy, idle], list(range(16))).address == "a:1"
    busy.num_inflight = 10
    assert policy.choose([busy, idle], list(range(16))).address == "b:1"   # matched a:1, but a:1 is swamped


def test_cache_aware_tree_is_bounded_and_forgets_removed_workers():
    policy = CacheAware(chunk_tokens=1, max_chunks_per_worker=8)
    w = worker("a:1")
    policy.choose([w], list(range(20)))
    assert len(policy._tree("a:1")) == 8
    policy.forget("a:1")
    assert len(policy._tree("a:1")) == 0


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")
