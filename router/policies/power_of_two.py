"""Power of two choices: sample two distinct workers at random, keep the less loaded one.

Nearly as even as least load while avoiding the herd effect of every router picking the same
"least loaded" worker from stale numbers (Mitzenmacher). Load is compared like least_load
(in-flight count, then KV usage). Knob: ``seed`` for a reproducible sequence of samples.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

from router.policies.least_load import load_key
from router.registry import WorkerState


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, workers: Sequence[WorkerState], prompt_token_ids: Sequence[int]) -> WorkerState:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return min(a, b, key=load_key)

    def forget(self, address: str) -> None:
        pass
