"""Cache aware (prefill): send a prompt where its prefix is most likely cached, unless load is skewed.

The router keeps an approximate prefix tree per prefill worker: prompts are cut into chunks
of ``chunk_tokens`` tokens and each chunk is named by a hash chained over all chunks before it
(the same idea as the workers' block hashes), so a set of chain hashes is a tree of prefixes.
Each worker's set is an LRU of at most ``max_chunks_per_worker`` entries; it approximates what
the worker's prefix cache holds without asking it.

For a prompt:
1. If load is imbalanced — ``max_load - min_load > balance_abs_threshold`` and
   ``max_load > balance_rel_threshold * min_load`` — fall back to least load.
2. Otherwise find the worker whose tree matches the longest prefix. If the matched fraction of
   the prompt is at least ``cache_threshold``, choose it.
3. Otherwise (a miss) choose the least loaded worker, ties by the smallest tree (the most room
   to cache new prefixes). sgl-router takes the smallest tree first; with prompts that share no
   prefix that sends every new prompt to a just-added replica (its tree is empty) while the old
   ones idle, until the load gap passes the balance thresholds.
The chosen worker's tree then records the prompt's chunks. Knobs are constructor arguments;
defaults follow sgl-router.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from router.policies.least_load import load_key
from router.registry import WorkerState


def chunk_hashes(token_ids: Sequence[int], chunk_tokens: int) -> list[int]:
    """Chained hashes of the full chunks of ``token_ids`` (a partial last chunk is not cached)."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - chunk_tokens + 1, chunk_tokens):
        parent = hash((parent, tuple(token_ids[start:start + chunk_tokens])))
        hashes.append(parent)
    return hashes


class PrefixTree:
    """One worker's approximate prefix cache: an LRU set of chained chunk hashes."""

    def __init__(self, max_chunks: int) -> None:
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading chunks are present."""
        for i, h in enumerate(hashes):
            if h not in self._chunks:
                return i
        return len(hashes)

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._chunks[h] = None
            self._chunks.move_to_end(h)
        while len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)


class CacheAware:
    name = "cache_aware"

    def __init__(self, chunk_tokens: int = 16, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, max_chunks_per_worker: int = 1 << 16) -> None:
        if chunk_tokens < 1 or max_chunks_per_worker < 1:
            raise ValueError("chunk_tokens and max_chunks_per_worker must be >= 1")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.chunk_tokens = chunk_tokens
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_chunks_per_worker = max_chunks_per_worker
        self._trees: dict[str, PrefixTree] = {}

    def _tree(self, address: str) -> PrefixTree:
        tree = self._trees.get(address)
        if tree is None:
            tree = self._trees[address] = PrefixTree(self.max_chunks_per_worker)
        return tree

    def imbalanced(self, workers: Sequence[WorkerState]) -> bool:
        loads = [w.load for w in workers]
        low, high = min(loads), max(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def choose(self, workers: Sequence[WorkerState], prompt_token_ids: Sequence[int]) -> WorkerState:
        hashes = chunk_hashes(prompt_token_ids, self.chunk_tokens)
        if len(workers) == 1:
            chosen = workers[0]
        elif self.imbalanced(workers):
            chosen = min(workers, key=load_key)
        else:
            matched = {w.address: self._tree(w.address).match(hashes) for w in workers}
            best = max(workers, key=lambda w: (matched[w.address], -w.load))
            ratio = matched[best.address] * self.chunk_tokens / max(len(prompt_token_ids), 1)
            if matched[best.address] and ratio >= self.cache_threshold:
                chosen = best
            else:
                chosen = min(workers, key=lambda w: (w.load, len(self._tree(w.address)), *load_key(w)))
        self._tree(chosen.address).insert(hashes)
        return chosen

    def forget(self, address: str) -> None:
        self._trees.pop(address, None)
