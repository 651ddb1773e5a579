"""Routing policies: which worker of a role gets a request (router process).

A policy sees only the healthy workers of one role (never empty) and the prompt's token ids,
and returns one of them. Load is the router's live count of requests on a worker
(``WorkerState.load``); KV usage comes from the last heartbeat. One module per policy.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.registry import WorkerState


class Policy(Protocol):
    name: str

    def choose(self, workers: Sequence[WorkerState], prompt_token_ids: Sequence[int]) -> WorkerState: ...

    def forget(self, address: str) -> None: ...


def make_policy(name: str, seed: int | None = None) -> Policy:
    from router.policies.cache_aware import CacheAware
    from router.policies.least_load import LeastLoad
    from router.policies.power_of_two import PowerOfTwo
    from router.policies.round_robin import RoundRobin

    policies: dict[str, type[Policy]] = {"round_robin": RoundRobin, "least_load": LeastLoad, "cache_aware": CacheAware}
    if name == "power_of_two":
        return PowerOfTwo(seed=seed)
    if name not in policies:
        raise ValueError(f"unknown policy {name!r}: use one of {sorted([*policies, 'power_of_two'])}")
    return policies[name]()
