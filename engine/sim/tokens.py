"""The simulated forward pass's arithmetic (pure Python): what a KV slot holds and which token
comes next.

Runs in the simulated engine's runner (engine/sim/runner.py). A slot at position p holds
K = (token id, p) and V = (digest_p), where digest_p chains digest_{p-1} with the token, as a
real model's KV summarizes the prefix. The token sampled at position p is a hash of the original
prompt's last digest and p: a resumed request (prompt = original prompt + the output streamed so
far) reads the same digest and gets the same tokens at the same positions.
"""
from __future__ import annotations

MASK31 = (1 << 31) - 1   # digests are stored as non-negative int32
DIGEST_SEED = 0x2545F491
FIRST_TEXT_TOKEN = 100   # below: special tokens in the usual vocabularies (never emitted)


def _mix(x: int) -> int:
    """splitmix64's finalizer: every input bit flips about half of the output bits."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def chain(digest: int, token_id: int) -> int:
    """The digest of a prefix one token longer."""
    return _mix((digest << 32) ^ token_id ^ 0x9E3779B97F4A7C15) & MASK31


def prompt_digest(token_ids: list[int]) -> int:
    digest = DIGEST_SEED
    for token_id in token_ids:
        digest = chain(digest, token_id)
    return digest


def next_token(digest: int, position: int, vocab_size: int) -> int:
    """The token at ``position`` of every stream whose original prompt has ``digest``."""
    first = min(FIRST_TEXT_TOKEN, vocab_size // 2)
    return first + _mix((digest << 24) ^ position) % (vocab_size - first)
