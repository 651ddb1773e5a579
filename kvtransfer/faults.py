"""Fault injection for kvtransfer's senders (prefill worker process): off unless asked for.

``TANDEM_KV_FAULT_RATE=p`` (0 < p <= 1) makes each ``ZmqSender.write`` fail with
probability p before a byte is sent, as a broken link or a refused write would: the op's future
raises ``InjectedFault`` and the prefill worker's usual failure path runs (the transfer is
cancelled at the decode worker, which frees the blocks and the router fails the request over).
``TANDEM_KV_FAULT_SEED`` makes the draws repeatable. Read once per sender, when it is created,
like SGLang's transfer-failure injection; the chaos soak (benchmarks/soak.py) and the tests use it.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

FAULT_RATE_ENV = "TANDEM_KV_FAULT_RATE"
FAULT_SEED_ENV = "TANDEM_KV_FAULT_SEED"


class InjectedFault(RuntimeError):
    """A KV write that ``TANDEM_KV_FAULT_RATE`` made fail."""


@dataclass
class FaultPlan:
    rate: float                      # probability that one write fails
    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"{FAULT_RATE_ENV}={self.rate}: use a probability in (0, 1], or unset it")
        self._rng = random.Random(self.seed)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> FaultPlan | None:
        """The plan the environment asks for; None when it asks for none (the default)."""
        env = os.environ if environ is None else environ
        raw = env.get(FAULT_RATE_ENV, "").strip()
        if not raw or float(raw) == 0.0:
            return None
        seed = env.get(FAULT_SEED_ENV, "").strip()
        return cls(float(raw), int(seed) if seed else None)

    def check(self, request_id: str) -> None:
        """Raises InjectedFault for this write with probability ``rate``."""
        if self._rng.random() < self.rate:
            raise InjectedFault(f"injected KV write fault ({FAULT_RATE_ENV}={self.rate}) request_id={request_id}")
