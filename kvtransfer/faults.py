"""Fault injection for kvtransfer's senders (prefill worker process): off unless asked for.

``TANDEM_KV_FAULT_RATE=p`` (0 < p <= 1) makes each request's KV transfer fail with probability
p, as a broken link or a refused write would: one of its first ``MAX_FAULT_WRITE + 1`` writes
(drawn per request), or its notify if it has fewer writes (a prompt whose KV goes in one write
once computed), raises ``InjectedFault`` before a byte of it is sent, and the prefill
worker's usual failure path runs (the transfer is cancelled at the decode worker, which frees
the blocks, and the router fails the request over). The draw is a hash of the request id, so a
retry (a new id) draws again; ``TANDEM_KV_FAULT_SEED`` makes the draws repeatable. Read once per
sender, when it is created, like SGLang's transfer-failure injection; the chaos soak
(benchmarks/soak.py) and the tests use it.
"""
from __future__ import annotations

import collections
import hashlib
import os
import secrets
from dataclasses import dataclass, field

FAULT_RATE_ENV = "TANDEM_KV_FAULT_RATE"
FAULT_SEED_ENV = "TANDEM_KV_FAULT_SEED"
MAX_FAULT_WRITE = 3          # a doomed transfer fails at one of its first 4 writes (layers)
MAX_DOOMED = 4096            # doomed requests remembered until their fault fires


class InjectedFault(RuntimeError):
    """A KV write that ``TANDEM_KV_FAULT_RATE`` made fail."""


@dataclass
class FaultPlan:
    rate: float                      # probability that one request's transfer fails
    seed: int | None = None
    _salt: bytes = field(init=False, repr=False)
    _countdown: collections.OrderedDict = field(init=False, repr=False)   # request_id -> writes left

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"{FAULT_RATE_ENV}={self.rate}: use a probability in (0, 1], or unset it")
        self._salt = str(self.seed).encode() if self.seed is not None else secrets.token_bytes(8)
        self._countdown = collections.OrderedDict()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> FaultPlan | None:
        """The plan the environment asks for; None when it asks for none (the default)."""
        env = os.environ if environ is None else environ
        raw = env.get(FAULT_RATE_ENV, "").strip()
        if not raw or float(raw) == 0.0:
            return None
        seed = env.get(FAULT_SEED_ENV, "").strip()
        return cls(float(raw), int(seed) if seed else None)

    def doomed(self, request_id: str) -> int | None:
        """The index of the write at which ``request_id``'s transfer fails; None if it does not."""
        digest = hashlib.blake2b(request_id.encode(), key=self._salt, digest_size=8).digest()
        draw = int.from_bytes(digest[:7], "big") / (1 << 56)
        return digest[7] % (MAX_FAULT_WRITE + 1) if draw < self.rate else None

    def check(self, request_id: str) -> None:
        """Called before each write of ``request_id``: raises InjectedFault at its doomed write."""
        left = self._countdown.get(request_id)
        if left is None:
            left = self.doomed(request_id)
            if left is None:
                return
        if left == 0:
            self._countdown.pop(request_id, None)
            raise InjectedFault(f"injected KV transfer fault ({FAULT_RATE_ENV}={self.rate}) request_id={request_id}")
        self._countdown[request_id] = left - 1
        while len(self._countdown) > MAX_DOOMED:
            self._countdown.popitem(last=False)

    def check_notify(self, request_id: str) -> None:
        """Called before ``request_id``'s notify: a doomed transfer whose fault has not fired fails here."""
        if self._countdown.pop(request_id, None) is not None:
            raise InjectedFault(f"injected KV transfer fault ({FAULT_RATE_ENV}={self.rate}) request_id={request_id}")
