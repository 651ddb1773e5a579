"""The incremental detokenizer's held window is bounded (engine.tokenizer.IncrementalDetokenizer).

Output that never completes a UTF-8 character (byte tokens forming no valid UTF-8) used to be
held, and the whole held window re-decoded, on every token: quadratic in the output's length.
These count the ids each ``tokenizer.decode`` call is given, so they do not depend on the
machine's speed, and check the streamed text against a decode of the whole sequence.
"""
from __future__ import annotations

import random

import pytest

from engine.tokenizer import IncrementalDetokenizer

NUM_TOKENS = 10_000
HELD_BOUND = 16   # IncrementalDetokenizer.MAX_HELD_TOKENS (a literal: the test also runs against code without it)
MAX_IDS_PER_DECODE = 4 * HELD_BOUND   # prefix + held + one chunk, each at most 2x the bound


class _CountingTokenizer:
    """A real tokenizer that fails the test as soon as one decode is given an unbounded window."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_decoded_ids = 0

    def decode(self, ids, skip_special_tokens=True):
        assert len(ids) <= MAX_IDS_PER_DECODE, f"decode of {len(ids)} ids: the held window grew"
        self.num_decoded_ids += len(ids)
        return self.inner.decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def fragments(smollm2_tokenizer) -> list[int]:
    """Ids whose text alone is U+FFFD: single bytes that are not a whole character."""
    tok = smollm2_tokenizer
    ids = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]
    assert len(ids) > 100
    return ids


def _stream(tok, ids: list[int], chunk: int = 1) -> str:
    detok = IncrementalDetokenizer(tok)
    parts = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return "".join(parts) + detok.finish()


def _byte_token(tok, byte: int) -> int:
    """The id of SmolLM2's token for one raw byte (GPT-2's byte-level alphabet: printable Latin-1
    bytes are themselves, the others are shifted to U+0100 onwards)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char = chr(byte) if byte in printable else chr(0x100 + sorted(set(range(256)) - set(printable)).index(byte))
    token_id = tok.token_to_id(char)
    assert token_id is not None and tok.decode([token_id]) == "\ufffd"
    return token_id


def test_ten_thousand_invalid_byte_tokens_cost_linear_decoding(smollm2_tokenizer):
    """Continuation bytes (0x80-0xBF) with no lead byte: the text ends in U+FFFD after every one."""
    tok = smollm2_tokenizer
    continuations = [_byte_token(tok, b) for b in range(0x80, 0xC0)]
    rng = random.Random(27)
    ids = [rng.choice(continuations) for _ in range(NUM_TOKENS)]
    counting = _CountingTokenizer(tok)
    text = _stream(counting, ids)
    assert text == tok.decode(ids)
    assert counting.num_decoded_ids <= MAX_IDS_PER_DECODE * NUM_TOKENS   # was ~NUM_TOKENS**2


def test_a_run_of_one_invalid_byte_is_emitted_as_it_comes(smollm2_tokenizer, fragments):
    tok = smollm2_tokenizer
    byte = next(i for i in fragments if tok.decode([i] * 5) == "\ufffd" * 5)
    ids = [byte] * NUM_TOKENS
    detok = IncrementalDetokenizer(_CountingTokenizer(tok))
    emitted = sum(len(detok.add([i])) for i in ids)
    # Everything but the last few ids (which could still begin a character) is out before the end.
    assert emitted >= NUM_TOKENS - HELD_BOUND
    assert emitted + len(detok.finish()) == NUM_TOKENS


@pytest.mark.parametrize("chunk", [1, 2, 5, 64, NUM_TOKENS])
def test_garbage_then_characters_split_across_tokens_match_a_full_decode(smollm2_tokenizer, fragments, chunk):
    """Held garbage longer than the bound, then emoji and CJK whose bytes span several tokens:
    the cut never falls inside a character, in any chunking of the stream."""
    tok = smollm2_tokenizer
    rng = random.Random(chunk)
    text = "emoji 🎉👍🏽 family 👨‍👩‍👧 rocket 🚀! 日本語のテキスト と 中文"
    ids = []
    for _ in range(20):
        ids += [rng.choice(fragments) for _ in range(rng.randint(0, 40))]
        ids += tok.encode(text, add_special_tokens=False)
    counting = _CountingTokenizer(tok)
    assert _stream(counting, ids, chunk) == tok.decode(ids)


@pytest.mark.parametrize("text", ["Café crème brûlée, naïve façade", "日本語のテキスト と 中文",
                                  "emoji 🎉👍🏽 family 👨‍👩‍👧 rocket 🚀!"])
def test_ordinary_text_still_matches_a_full_decode(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text * 20, add_special_tokens=False)
    assert _stream(_CountingTokenizer(smollm2_tokenizer), ids) == smollm2_tokenizer.decode(ids) == text * 20


def test_random_fragment_mixes_match_a_full_decode(smollm2_tokenizer, fragments):
    tok = smollm2_tokenizer
    rng = random.Random(1234)
    for _ in range(200):
        ids = [rng.choice(fragments) if rng.random() < 0.8 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 120))]
        assert _stream(_CountingTokenizer(tok), ids, rng.randint(1, 7)) == tok.decode(ids), ids
