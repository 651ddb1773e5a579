"""Round robin: workers in address order, one after the other.

No knobs. Ignores load and prompts; useful as a baseline and when workers are identical and
requests uniform. The cursor survives membership changes (it is taken modulo the live count).
"""
from __future__ import annotations

from collections.abc import Sequence

from router.registry import WorkerState


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: Sequence[WorkerState], prompt_token_ids: Sequence[int]) -> WorkerState:
        ordered = sorted(workers, key=lambda w: w.address)
        worker = ordered[self._next % len(ordered)]
        self._next += 1
        return worker

    def forget(self, address: str) -> None:
        pass
