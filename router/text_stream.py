"""Incremental detokenization with stop strings, applied in the router (router process).

``add(token_ids)`` returns the text that is safe to release and whether a stop string was hit.
Text that could still become the start of a stop string is held back, so a stop string is
never streamed; on a hit the text before it is released and the caller aborts the request.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (),
                 keep_token_ids: frozenset[int] = frozenset()) -> None:
        """``keep_token_ids``: special tokens written into the text (a tool-call format's markers)."""
        self._detok = IncrementalDetokenizer(tokenizer, keep_token_ids=keep_token_ids)
        self._stop = tuple(stop)
        self._held = ""
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        return self._release(self._held + self._detok.add(token_ids), final=False)

    def finish(self) -> str:
        """The rest of the text once the stream has ended."""
        return self._release(self._held + self._detok.finish(), final=True)

    def _release(self, text: str, final: bool) -> str:
        if not self._stop:
            return text
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return text[:min(hits)]
        keep = 0 if final else self._partial_stop_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
