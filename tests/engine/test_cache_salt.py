"""A request's ``cache_salt`` separates prefix caches (engine/block_manager.py, engine/scheduler.py).

The salt is mixed into the hash of a prompt's first block only; every later hash chains from it,
so two salts share no block, one salt shares as an unsalted cache does, and the proto conversion
carries the salt to the engine of both worker roles.
"""
from __future__ import annotations

import pytest

from engine.block_manager import BlockAllocator, hash_block
from engine.config import MAX_CACHE_SALT_CHARS, SamplingParams
from tests.models import random_prompt
from worker.convert import sampling_from_proto, sampling_to_proto

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_salt_is_mixed_into_the_first_block_only_and_separates_caches():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    tokens = list(range(10))
    blocks = allocator.allocate(3)
    assert allocator.cache_full_blocks(blocks, tokens, num_cached_blocks=0, extra_key=b"tenant-a") == 2
    first = hash_block(None, tokens[:4], b"tenant-a")
    assert allocator.block_hash(blocks[0]) == first
    assert allocator.block_hash(blocks[1]) == hash_block(first, tokens[4:8])   # chains, no salt again
    allocator.free(blocks[::-1])

    assert allocator.peek_prefix_blocks(tokens, b"tenant-b") == 0
    assert allocator.peek_prefix_blocks(tokens) == 0
    assert allocator.match_prefix(tokens, b"tenant-b") == []
    assert allocator.match_prefix(tokens, b"tenant-a") == blocks[:2]
    assert allocator.num_prefix_hit_tokens == 8


def test_an_engine_shares_cached_blocks_only_between_requests_with_one_salt(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir("llama"))
    allocator = llm.engine.allocator
    prompt = random_prompt(seed=31, num_tokens=40)     # 2 full blocks a later request may hit
    params = {salt: SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, cache_salt=salt)
              for salt in ("", "tenant-a", "tenant-b")}

    def hit_tokens(salt: str) -> tuple[int, list[int]]:
        before = allocator.num_prefix_hit_tokens
        [out] = llm.generate(prompt, params[salt])
        return allocator.num_prefix_hit_tokens - before, out.token_ids

    hits_a, tokens_a = hit_tokens("tenant-a")
    assert hits_a == 0
    assert llm.engine.num_cached_prefix_tokens(prompt, "tenant-a") == 32
    assert llm.engine.num_cached_prefix_tokens(prompt, "tenant-b") == 0
    assert llm.engine.num_cached_prefix_tokens(prompt) == 0
    assert hit_tokens("tenant-b") == (0, tokens_a)       # another tenant: nothing shared
    assert hit_tokens("") == (0, tokens_a)               # no salt: a cache of its own too
    assert hit_tokens("tenant-a") == (32, tokens_a)      # the same tenant shares as before
    assert hit_tokens("") == (32, tokens_a)              # and so do unsalted requests
    assert allocator.num_used_blocks == 0


def test_the_salt_travels_through_the_workers_proto_and_is_bounded():
    params = SamplingParams(temperature=0.0, max_tokens=3, cache_salt="tenant-a")
    msg = sampling_to_proto(params)
    assert msg.cache_salt == "tenant-a"
    assert sampling_from_proto(msg) == params
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).cache_salt == ""
    msg.cache_salt = "s" * (MAX_CACHE_SALT_CHARS + 1)
    with pytest.raises(ValueError, match="cache_salt is 257 characters"):
        sampling_from_proto(msg)
