"""What the router's admission (``Frontend.admit``) measures: the queue of requests waiting for
their first token and what it costs to drain, and the pace of the decode streams.

``WaitingQueue`` counts the waiting requests and their prompt tokens (the dispatcher tells it
when a request opens and when it leaves the queue: first token, or gone before one), and
measures what the queue costs to drain: each first token comes with the busy time since the one
before (time with at least one request waiting), and a least-squares fit over them gives the
seconds per request (routing, a decode step, a KV transfer) and per prompt token (the prefill).
One tokens-per-second rate would not do in a mixed load: a short prompt's wait is mostly the
per-request part, a long one's its tokens. The fit's sums decay exponentially (time constant
``window_s``), so it follows a load that changes -- a growing decode batch slows a prefill done
beside it. Time with nothing waiting is left out: an idle router drains only what arrives, which
says nothing of what it could do.

``predicted_wait_s`` is the wait of a request arriving now: the requests and tokens ahead of it
plus its own, at that cost. ``Frontend.admit`` refuses (429) a request whose prediction passes
``--max-predicted-wait-s``: under overload a client hears at once that its first token would come
too late, and the requests already taken keep their TTFT, instead of every TTFT growing with the
queue (docs/api.md). The prediction is a cost, not a schedule: a prompt found in the prefix cache
drains faster than its length says, and routes that run in parallel (local prefill beside a
prefill worker) are fitted as one queue.

``DecodePace`` is the recent time per output token over every stream: the seconds between a
stream's messages over the tokens they carried (the first token, TTFT, left out), decayed over
``window_s`` (about a request's decode lifetime). ``Frontend.admit`` refuses (429) while it is
above ``--max-tpot-s``: each request taken adds a stream to the decode batch and a prefill beside
it, and a TPOT objective is missed by every stream at once when the batch grows past what the
cores step in time. It is a measurement, not a prediction: the requests taken while the pace is
just under the limit push it over, so set the limit a little under the objective.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

MIN_PACED_TOKENS = 4    # decayed output tokens behind a pace: fewer (nothing streamed lately) is no pace
MIN_DRAINED = 4   # first tokens seen before the fit is trusted (the first requests warm caches and threads)


class WaitingQueue:
    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.num_requests = 0
        self.num_tokens = 0            # prompt tokens of the waiting requests
        self.num_drained = 0           # requests that got their first token, ever
        self._gap_s = 0.0              # busy seconds since the last first token
        # Decayed sums over first tokens, each with its prompt tokens t and the busy gap g before
        # it: weight, t, t^2, g, g*t -- a least-squares fit of g = a + b*t.
        self._sums = [0.0] * 5
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
            t, g = float(num_tokens), self._gap_s
            for i, x in enumerate((1.0, t, t * t, g, g * t)):
                self._sums[i] += x
            self._gap_s = 0.0
            self.num_drained += 1

    def cost(self) -> tuple[float, float] | None:
        """(seconds per request, seconds per prompt token) the queue drains at; None until
        MIN_DRAINED requests have had their first token. Fitted over first tokens: a short
        prompt's wait is mostly per-request work (routing, a decode step), a long one's its
        tokens, so one tokens-per-second rate would overcharge long prompts in a mixed load."""
        self._advance()
        n, st, stt, sg, sgt = self._sums
        if self.num_drained < MIN_DRAINED or n <= 0.0:
            return None
        var = n * stt - st * st
        if var <= 1e-9 * n * stt:          # prompts all alike: no telling the two apart
            return 0.0, sg / st
        per_token = (n * sgt - st * sg) / var
        per_request = (sg - per_token * st) / n
        if per_token < 0.0:                # a fit out of range: the better of the two alone
            return sg / n, 0.0
        if per_request < 0.0:
            return 0.0, sg / st
        return per_request, per_token

    def predicted_wait_s(self, num_new_tokens: int, num_new_requests: int = 1) -> float | None:
        """Seconds until the first token of requests of ``num_new_tokens`` arriving now: the
        queue's requests and tokens and theirs at the fitted cost; None while it is unknown."""
        cost = self.cost()
        if cost is None:
            return None
        per_request, per_token = cost
        return per_request * (self.num_requests + num_new_requests) + per_token * (self.num_tokens + num_new_tokens)

    def _advance(self) -> None:
        now = self.clock()
        elapsed, self._last_s = now - self._last_s, now
        if self.num_requests:
            self._gap_s += elapsed
        decay = math.exp(-elapsed / self.window_s)
        self._sums = [x * decay for x in self._sums]


class DecodePace:
    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._seconds = 0.0   # decayed: time between a stream's messages after its first token
        self._tokens = 0.0    # decayed: the tokens those messages carried
        self._last_s = clock()
        self.num_streams = 0  # streams running now (Frontend.stream)

    def add(self, seconds: float, num_tokens: int) -> None:
        """A stream's message of ``num_tokens`` tokens, ``seconds`` after its previous one."""
        self._advance()
        self._seconds += seconds
        self._tokens += num_tokens

    def seconds_per_token(self) -> float | None:
        """The recent time per output token; None when no stream runs (the pace of streams that
        have all ended says nothing of a new one's) or too few tokens streamed lately."""
        self._advance()
        if not self.num_streams or self._tokens < MIN_PACED_TOKENS:
            return None
        return self._seconds / self._tokens

    def _advance(self) -> None:
        now = self.clock()
        decay = math.exp(-(now - self._last_s) / self.window_s)
        self._last_s = now
        self._seconds *= decay
        self._tokens *= decay
