"""Least load: the worker with the fewest requests in flight from this router.

Ties go to the lower KV-cache usage from the last heartbeat, then to the address (so the
choice is deterministic). The in-flight count is live (updated as requests start and end),
so a burst spreads evenly even between heartbeats; KV usage separates workers whose queues
are equal but whose sequences are longer. This is the default for decode ("least KV usage /
queue"). No knobs.
"""
from __future__ import annotations

from collections.abc import Sequence

from router.registry import WorkerState


def load_key(worker: WorkerState) -> tuple[int, float, str]:
    return worker.load, worker.kv_usage, worker.address


class LeastLoad:
    name = "least_load"

    def choose(self, workers: Sequence[WorkerState], prompt_token_ids: Sequence[int]) -> WorkerState:
        return min(workers, key=load_key)

    def forget(self, address: str) -> None:
        pass
