"""Unit tests for engine.block_manager: exact block ids, ref counts and free-queue order."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import block_manager
from engine.block_manager import BlockAllocator, NoFreeBlocksError, hash_block

REPO_ROOT = Path(__file__).resolve().parents[2]


def drain(allocator: BlockAllocator) -> list[int]:
    """The free queue, head first, read by allocating every free block."""
    return allocator.allocate(allocator.num_free_blocks)


def test_fresh_allocator_hands_out_lowest_ids_and_reuses_lru():
    allocator = BlockAllocator(num_blocks=6, block_size=4)
    assert allocator.allocate(3) == [0, 1, 2]
    assert [allocator.ref_count(i) for i in range(6)] == [1, 1, 1, 0, 0, 0]
    assert allocator.num_free_blocks == 3
    assert allocator.num_used_blocks == 3
    assert allocator.usage == 0.5

    allocator.free([2, 1, 0])
    assert allocator.num_free_blocks == 6
    assert [allocator.ref_count(i) for i in range(3)] == [0, 0, 0]
    # Never-used blocks sit ahead of freed ones; freed ones keep the order they were given.
    assert allocator.allocate(1) == [3]
    assert drain(allocator) == [4, 5, 2, 1, 0]
    assert allocator.num_free_blocks == 0
    assert allocator.usage == 1.0


def test_double_free_raises_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    assert allocator.allocate(2) == [0, 1]
    allocator.free([0])
    with pytest.raises(ValueError, match="double free of block 0"):
        allocator.free([0])
    # Block 1 holds one reference; freeing it twice in one call must fail before any change.
    with pytest.raises(ValueError, match="double free of block 1"):
        allocator.free([1, 1])
    assert allocator.ref_count(1) == 1
    assert allocator.num_free_blocks == 3
    assert drain(allocator) == [2, 3, 0]


def test_allocate_beyond_capacity_raises_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    block_ids = allocator.allocate(2)
    assert block_ids == [0, 1]
    assert allocator.cache_full_blocks(block_ids, [7, 8, 9, 10], num_cached_blocks=0) == 2
    allocator.free(block_ids[::-1])

    with pytest.raises(NoFreeBlocksError, match="requested 5 blocks but only 4 are free"):
        allocator.allocate(5)
    assert allocator.num_free_blocks == 4
    assert allocator.block_hash(0) is not None
    assert allocator.block_hash(1) is not None
    # The cached blocks were not evicted by the failed call.
    assert allocator.match_prefix([7, 8, 9, 10, 11]) == [0, 1]
    assert drain(allocator) == [2, 3]


def test_prefix_hit_shares_blocks_and_stops_at_first_miss():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    tokens_a = list(range(10))  # 2.5 blocks
    blocks_a = allocator.allocate(3)
    assert blocks_a == [0, 1, 2]
    assert allocator.cache_full_blocks(blocks_a, tokens_a, num_cached_blocks=0) == 2
    assert allocator.block_hash(0) == hash_block(None, [0, 1, 2, 3])
    assert allocator.block_hash(1) == hash_block(allocator.block_hash(0), [4, 5, 6, 7])
    assert allocator.block_hash(2) is None  # partial block

    tokens_b = tokens_a[:8] + [100, 101, 102]
    assert allocator.match_prefix(tokens_b) == [0, 1]
    assert [allocator.ref_count(i) for i in range(3)] == [2, 2, 1]

    tokens_c = tokens_a[:5] + [99] + tokens_a[6:8] + [1]  # differs inside block 1
    assert allocator.match_prefix(tokens_c) == [0]
    assert [allocator.ref_count(i) for i in range(3)] == [3, 2, 1]
    assert allocator.num_free_blocks == 5

    # A different extra key (e.g. a LoRA adapter) is a different cache.
    assert allocator.match_prefix(tokens_b, extra_key=b"lora-1") == []
    assert allocator.ref_count(0) == 3


def test_forged_hash_collision_is_rejected_by_token_check(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block", lambda *args, **kwargs: b"\x00" * 16)
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    block_ids = allocator.allocate(2)
    assert allocator.cache_full_blocks(block_ids, [1, 2, 3, 4], num_cached_blocks=0) == 2

    # Every block hashes alike, so every lookup lands on block 0, the hash's first owner.
    assert allocator.match_prefix([5, 6, 7]) == []
    assert allocator.match_prefix([1, 2, 3, 4, 5]) == [0]  # block 1's lookup finds block 0
    assert allocator.ref_count(0) == 2
    assert allocator.ref_count(1) == 1


def test_last_token_is_never_matched():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    tokens = list(range(8))  # exactly 2 full blocks
    block_ids = allocator.allocate(2)
    assert allocator.cache_full_blocks(block_ids, tokens, num_cached_blocks=0) == 2

    assert allocator.match_prefix(tokens) == [0]
    assert allocator.match_prefix(tokens + [8]) == [0, 1]
    assert allocator.match_prefix(tokens[:1]) == []
    assert allocator.match_prefix([]) == []
    assert [allocator.ref_count(i) for i in range(2)] == [3, 2]


def test_freed_cached_blocks_are_evicted_lru_and_unmapped():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    block_ids = allocator.allocate(2)
    assert block_ids == [0, 1]
    assert allocator.cache_full_blocks(block_ids, [1, 2, 3, 4], num_cached_blocks=0) == 2
    allocator.free(block_ids[::-1])  # tail block first, so it is evicted first
    assert allocator.num_free_blocks == 4

    assert allocator.allocate(3) == [2, 3, 1]
    assert allocator.block_hash(1) is None
    assert allocator.block_hash(0) is not None
    assert allocator.ref_count(1) == 1

    # Block 0 is still cached and free: a hit takes it out of the free queue.
    assert allocator.match_prefix([1, 2, 3, 4, 5]) == [0]
    assert allocator.ref_count(0) == 1
    assert allocator.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError, match="requested 1 blocks but only 0 are free"):
        allocator.allocate(1)


def test_hit_on_free_cached_block_removes_it_from_the_free_queue():
    allocator = BlockAllocator(num_blocks=5, block_size=2)
    block_ids = allocator.allocate(3)
    assert allocator.cache_full_blocks(block_ids, [1, 2, 3, 4, 5, 6], num_cached_blocks=0) == 3
    allocator.free(block_ids[::-1])
    assert allocator.match_prefix([1, 2, 3, 4, 9]) == [0, 1]
    assert allocator.num_free_blocks == 3
    assert drain(allocator) == [3, 4, 2]
    assert allocator.block_hash(2) is None
    assert allocator.block_hash(0) is not None


def test_duplicate_block_keeps_chain_but_not_ownership():
    allocator = BlockAllocator(num_blocks=6, block_size=2)
    blocks_a = allocator.allocate(1)
    blocks_b = allocator.allocate(2)
    assert (blocks_a, blocks_b) == ([0], [1, 2])
    assert allocator.cache_full_blocks(blocks_a, [1, 2], num_cached_blocks=0) == 1
    # B computed the same first block without a hit: block 1 duplicates block 0.
    assert allocator.cache_full_blocks(blocks_b, [1, 2, 3], num_cached_blocks=0) == 1
    assert allocator.block_hash(1) == allocator.block_hash(0)
    assert allocator.match_prefix([1, 2, 3]) == [0]

    # B's next block chains from its duplicate's hash.
    assert allocator.cache_full_blocks(blocks_b, [1, 2, 3, 4], num_cached_blocks=1) == 2
    assert allocator.block_hash(2) == hash_block(hash_block(None, [1, 2]), [3, 4])
    assert allocator.match_prefix([1, 2, 3, 4, 5]) == [0, 2]

    # Evicting the duplicate must not unmap the owner.
    allocator.free([1])
    assert allocator.allocate(4) == [3, 4, 5, 1]
    assert allocator.block_hash(1) is None
    assert allocator.match_prefix([1, 2, 3]) == [0]


def test_prefix_counters_count_tokens():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    block_ids = allocator.allocate(2)
    allocator.cache_full_blocks(block_ids, list(range(8)), num_cached_blocks=0)

    allocator.match_prefix(list(range(9)))  # 9 queried, 8 hit
    allocator.match_prefix([50, 51, 52, 53, 54])  # 5 queried, 0 hit
    allocator.match_prefix(list(range(6)))  # 6 queried, 4 hit
    assert allocator.num_prefix_queries_tokens == 20
    assert allocator.num_prefix_hit_tokens == 12


def test_prefix_caching_disabled_is_a_no_op():
    allocator = BlockAllocator(num_blocks=4, block_size=2, enable_prefix_caching=False)
    block_ids = allocator.allocate(2)
    assert allocator.cache_full_blocks(block_ids, [1, 2, 3, 4], num_cached_blocks=0) == 0
    assert allocator.block_hash(0) is None
    assert allocator.match_prefix([1, 2, 3, 4, 5]) == []
    assert allocator.num_prefix_queries_tokens == 0
    assert allocator.ref_count(0) == 1


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    block_ids = allocator.allocate(2)
    allocator.cache_full_blocks(block_ids, [1, 2, 3, 4], num_cached_blocks=0)
    assert allocator.reset_prefix_cache() is False
    assert allocator.block_hash(0) is not None

    allocator.free(block_ids[::-1])
    assert allocator.reset_prefix_cache() is True
    assert allocator.block_hash(0) is None
    assert allocator.match_prefix([1, 2, 3, 4, 5]) == []
    assert drain(allocator) == [2, 3, 1, 0]


def test_hash_block_chains_over_parent_tokens_and_extra_key():
    root = hash_block(None, [1, 2, 3])
    assert len(root) == 16
    assert hash_block(None, [1, 2, 3]) == root
    assert hash_block(None, [1, 2, 4]) != root
    assert hash_block(root, [1, 2, 3]) != root
    assert hash_block(None, [1, 2, 3], b"salt") != root
    assert hash_block(None, [1, 2, 3], b"") == root  # no extra key and an empty one agree


_HASH_SNIPPET = (
    "from engine.block_manager import hash_block; "
    "print(hash_block(hash_block(None, [1, 2, 3]), [4, 5, -1, 2**40], b'lora').hex())"
)


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_hash_block_is_deterministic_across_processes(hash_seed):
    expected = hash_block(hash_block(None, [1, 2, 3]), [4, 5, -1, 2**40], b"lora").hex()
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    result = subprocess.run(
        [sys.executable, "-c", _HASH_SNIPPET],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == expected


def test_block_manager_does_not_import_torch():
    result = subprocess.run(
        [sys.executable, "-c", "import sys, engine.block_manager; print('torch' in sys.modules)"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "False"
