"""Paged KV cache block allocator: ref counts, an LRU free queue and prefix hashing.

Runs inside each worker process (prefill and decode), driven by that worker's scheduler. It is
pure bookkeeping over block ids — it never touches tensors and imports no torch, so the
scheduler stays cheap to import and to test (docs/architecture.md#kv-cache).

Model (vLLM v1 / nano-vllm):

* Every block has a ``ref_count``: the number of running sequences whose block table holds it.
* Blocks with ``ref_count == 0`` sit in one free queue, oldest-freed at the head. A free block
  may still carry the hash and token ids of a full block it held: it is an *evictable cached*
  block, reusable by a prefix hit until ``allocate`` pops it from the head and evicts it.
* A full block's hash chains from its parent's hash (``hash_block``), so equal hashes mean
  equal whole prefixes. On a hash hit the stored token ids are compared as well, so a hash
  collision can never hand a sequence someone else's KV.
* An ``extra_key`` (a request's ``cache_salt``, a LoRA adapter) is mixed into the hash of the
  first block only, as vLLM does: every later hash chains from it, so two keys share no block
  at all, and a sequence's later blocks are hashed without it.

Every method costs O(blocks touched), never O(num_blocks), except ``reset_prefix_cache``.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Block", "BlockAllocator", "NoFreeBlocksError", "hash_block"]

_HASH_NBYTES = 16


class NoFreeBlocksError(RuntimeError):
    """Fewer free blocks than requested; the scheduler should wait or preempt."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Content hash of the full block this block holds (None while partial or after eviction).
    block_hash: bytes | None = None
    # The tokens behind block_hash, compared on every hash hit.
    token_ids: tuple[int, ...] = ()


def hash_block(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: bytes | None = None
) -> bytes:
    """Chained 16-byte hash of one full block, identical in every process and on every host.

    Python's ``hash()`` is salted per process (PYTHONHASHSEED), so it cannot be used: a prefill
    worker and a decode worker must agree. Each field is length-prefixed so no two different
    (parent, tokens, extra) triples encode to the same bytes; token ids are packed as
    little-endian int64 whatever the host's byte order. ``extra_key`` separates caches that
    share token ids but not KV (LoRA adapter, multimodal inputs, a per-tenant salt); ``None``
    and ``b""`` are the same key.
    """
    parent = parent_hash or b""
    extra = extra_key or b""
    h = hashlib.blake2b(digest_size=_HASH_NBYTES)
    h.update(struct.pack("<Q", len(parent)))
    h.update(parent)
    h.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<Q", len(extra)))
    h.update(extra)
    return h.digest()


class BlockAllocator:
    """Hands out KV block ids, counts their references and remembers full blocks by hash.

    The free queue is an ``OrderedDict`` used as an O(1) ordered set: ``allocate`` pops from
    the head, ``free`` appends to the tail, and a prefix hit removes a block from the middle.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Exactly one owner per hash; a block holding the same content later is a duplicate
        # that keeps its own block_hash (so its sequence's chain continues) but is not findable.
        self._hash_to_block_id: dict[bytes, int] = {}
        # Prefix-cache metrics, in tokens.
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0

    # -- capacity -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, evictable cached blocks included."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> bytes | None:
        return self._blocks[block_id].block_hash

    # -- allocation -----------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ref_count 1.

        A popped block that still holds a cached full block is evicted first. All or nothing:
        raises NoFreeBlocksError, changing no state, when too few blocks are free.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free_queue):
            raise NoFreeBlocksError(
                f"requested {num_blocks} blocks but only {len(self._free_queue)} are free"
            )
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self._blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail.

        They join in the order given and eviction takes from the head, so a sequence should
        pass its block table reversed: its tail blocks — the least likely to be shared as a
        prefix — are then evicted before its head blocks. A block may appear more than once.
        Raises ValueError, changing no state, if that would take a ref_count below 0.
        """
        for block_id, num_refs in Counter(block_ids).items():
            if self._blocks[block_id].ref_count < num_refs:
                raise ValueError(
                    f"double free of block {block_id}: ref_count is "
                    f"{self._blocks[block_id].ref_count}, asked to free {num_refs} time(s)"
                )
        for block_id in block_ids:
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block_id] = None

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block, taking free (cached) ones out of the free queue."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free_queue[block_id]
            block.ref_count += 1

    # -- prefix caching -------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], extra_key: bytes | None = None) -> list[int]:
        """Return the cached blocks holding the longest prefix of ``token_ids``, touched.

        Only full blocks are matched, and never the last token: at least one token must be
        left to compute so the forward pass produces logits for the next one. The walk stops
        at the first block whose hash is unknown or whose stored tokens differ.
        """
        if not self.enable_prefix_caching:
            return []
        hit_block_ids = self._lookup(token_ids, extra_key)
        self.touch(hit_block_ids)
        self.num_prefix_queries_tokens += len(token_ids)
        self.num_prefix_hit_tokens += len(hit_block_ids) * self.block_size
        return hit_block_ids

    def peek_prefix_blocks(self, token_ids: Sequence[int], extra_key: bytes | None = None) -> int:
        """How many blocks ``match_prefix`` would hit, without touching or counting anything."""
        return len(self._lookup(token_ids, extra_key)) if self.enable_prefix_caching else 0

    def _lookup(self, token_ids: Sequence[int], extra_key: bytes | None) -> list[int]:
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        hit_block_ids: list[int] = []
        parent_hash: bytes | None = None
        for i in range(max_blocks):
            block_tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent_hash = hash_block(parent_hash, block_tokens, extra_key if i == 0 else None)
            block_id = self._hash_to_block_id.get(parent_hash)
            if block_id is None or self._blocks[block_id].token_ids != block_tokens:
                break
            hit_block_ids.append(block_id)
        return hit_block_ids

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        token_ids: Sequence[int],
        num_cached_blocks: int,
        extra_key: bytes | None = None,
    ) -> int:
        """Hash a sequence's newly completed full blocks and return its new cached-block count.

        ``block_ids`` is the sequence's block table and ``token_ids`` all its tokens so far;
        blocks ``num_cached_blocks .. len(token_ids) // block_size - 1`` get hashed, chaining
        from block ``num_cached_blocks - 1``. A hash another block already owns is left
        pointing at that owner. No-op when prefix caching is disabled.
        """
        if not self.enable_prefix_caching:
            return num_cached_blocks
        num_full_blocks = min(len(token_ids) // self.block_size, len(block_ids))
        if num_cached_blocks >= num_full_blocks:
            return num_cached_blocks
        parent_hash = (
            self._blocks[block_ids[num_cached_blocks - 1]].block_hash
            if num_cached_blocks > 0
            else None
        )
        for i in range(num_cached_blocks, num_full_blocks):
            block = self._blocks[block_ids[i]]
            block_tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent_hash = hash_block(parent_hash, block_tokens, extra_key if i == 0 else None)
            if block.block_hash != parent_hash:
                self._evict(block)  # re-caching over stale content must not leave it mapped
            block.block_hash = parent_hash
            block.token_ids = block_tokens
            self._hash_to_block_id.setdefault(parent_hash, block.block_id)
        return num_full_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; returns False, changing nothing, if any block is in use.

        Refusing while blocks are in use (as vLLM does) keeps running sequences' hash chains
        intact: ``cache_full_blocks`` chains from the hash stored on their last cached block.
        O(num_blocks); meant for tests, benchmarks and weight reloads, not the hot path.
        """
        if self.num_used_blocks > 0:
            return False
        for block in self._blocks:
            block.block_hash = None
            block.token_ids = ()
        self._hash_to_block_id.clear()
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        # Only the owner is in the map; a duplicate's hash must not unmap the owner.
        if self._hash_to_block_id.get(block.block_hash) == block.block_id:
            del self._hash_to_block_id[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
