"""What the router's admission (``Frontend.admit``) measures: the queue of requests waiting for
their first token and how fast it drains, and the pace of the decode streams.

``WaitingQueue`` counts the waiting requests and their prompt tokens (the dispatcher tells it
when a request opens and when it leaves the queue: first token, or gone before one), and
measures the queue's drain rate: prompt tokens that got their first token, over the time the
queue held at least one request. Both sums decay exponentially (time constant ``window_s``), so
the rate follows a load that changes -- a growing decode batch slows a prefill done beside it.
Time with nothing waiting is left out: an idle router drains only what arrives, which says
nothing of what it could do. What that time holds (routing, the prefill, the KV transfer, a
decode slot freeing up) is what a new request's first token waits for too.

``predicted_wait_s`` is the wait of a request arriving now: the tokens ahead of it plus its own,
over that rate. ``Frontend.admit`` refuses (429) a request whose prediction passes
``--max-predicted-wait-s``: under overload a client hears at once that its first token would come
too late, and the requests already taken keep their TTFT, instead of every TTFT growing with the
queue (docs/api.md). The prediction is a rate, not a schedule: a prompt found in the prefix cache
drains faster than its length says, and routes that run in parallel (local prefill beside a
prefill worker) are summed into one rate.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

MIN_PACED_TOKENS = 4    # decayed output tokens behind a pace: fewer (nothing streamed lately) is no pace
MIN_DRAINED = 4   # first tokens seen before the rate is trusted (the first requests warm caches and threads)


class WaitingQueue:
    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.num_requests = 0
        self.num_tokens = 0            # prompt tokens of the waiting requests
        self.num_drained = 0           # requests that got their first token, ever
        self._drained_tokens = 0.0     # decayed: prompt tokens that got their first token
        self._busy_s = 0.0             # decayed: seconds with at least one request waiting
        self._gap_s = 0.0              # busy seconds since the last first token
        self._last_s = clock()

    def enter(self, num_tokens: int) -> None:
        self._advance()
        self.num_requests += 1
        self.num_tokens += num_tokens

    def leave(self, num_tokens: int, first_token: bool) -> None:
        """A request left the queue: with its first token, or without one (abandoned, failed)."""
        self._advance()
        self.num_requests -= 1
        self.num_tokens -= num_tokens
        if first_token:
            # Its tokens drained over the busy time since the last first token: spread them over
            # it, so they decay as that time does (counted whole now, a slow prefill would weigh
            # more than the seconds it took).
            spread = self._gap_s / self.window_s
            self._drained_tokens += num_tokens * (-math.expm1(-spread) / spread if spread > 0 else 1.0)
            self._gap_s = 0.0
            self.num_drained += 1

    def tokens_per_s(self) -> float | None:
        """The drain rate; None until MIN_DRAINED requests have had their first token."""
        self._advance()
        if self.num_drained < MIN_DRAINED or self._busy_s <= 0.0:
            return None
        return self._drained_tokens / self._busy_s

    def predicted_wait_s(self, num_new_tokens: int) -> float | None:
        """Seconds until the first token of a request of ``num_new_tokens`` arriving now; None
        while the rate is unknown."""
        rate = self.tokens_per_s()
        if rate is None:
            return None
        return (self.num_tokens + num_new_tokens) / rate if rate > 0 else math.inf

    def _advance(self) -> None:
        now = self.clock()
        elapsed, self._last_s = now - self._last_s, now
        decay = math.exp(-elapsed / self.window_s)
        self._drained_tokens *= decay
        # The busy time decays like the tokens; a busy stretch adds its own decayed length.
        self._busy_s *= decay
        if self.num_requests:
            self._busy_s += self.window_s * -math.expm1(-elapsed / self.window_s)
            self._gap_s += elapsed


class DecodePace:
    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._seconds = 0.0   # decayed: time between a stream's messages after its first token
        self._tokens = 0.0    # decayed: the tokens those messages carried
        self._last_s = clock()

    def add(self, seconds: float, num_tokens: int) -> None:
        """A stream's message of ``num_tokens`` tokens, ``seconds`` after its previous one."""
        self._advance()
        self._seconds += seconds
        self._tokens += num_tokens

    def seconds_per_token(self) -> float | None:
        """The recent time per output token; None when too few tokens streamed lately."""
        self._advance()
        return self._seconds / self._tokens if self._tokens >= MIN_PACED_TOKENS else None

    def _advance(self) -> None:
        now = self.clock()
        decay = math.exp(-(now - self._last_s) / self.window_s)
        self._last_s = now
        self._seconds *= decay
        self._tokens *= decay
