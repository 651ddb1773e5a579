"""The load generator of `tandem bench`: one asyncio loop in the bench process.

Requests arrive as a Poisson process of mean rate ``request_rate`` (exponential gaps from a
generator seeded with ``seed``; ``inf`` sends them all at t=0), in workload order. A request
that has arrived waits on a semaphore of ``max_concurrency`` before it is sent, and its clock
starts only when it is sent, as in `vllm bench serve`. The run's duration is from the first
arrival to the last request's end; throughputs divide by it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from deploy.bench.backends import make_backend
from deploy.bench.config import EndpointConfig, LoadConfig
from deploy.bench.datasets import BenchRequest
from deploy.bench.record import RequestRecord

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float


def arrival_times_s(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times from the start: cumulative exponential gaps of mean 1 / rate (all 0 at inf)."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, num_requests)
    gaps[0] = 0.0   # the first request opens the run
    return np.cumsum(gaps).tolist()


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator:
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, unit="req", desc="bench", dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


async def _one(backend, request: BenchRequest, record: RequestRecord, gate: asyncio.Semaphore | None,
               bar) -> None:
    async with gate if gate is not None else contextlib.nullcontext():
        try:
            await backend.send(request, record)
        except Exception as exc:  # a backend bug must cost one request, not the run
            logger.exception("request_id=%s failed unexpectedly", record.request_id)
            record.success, record.error = False, f"{type(exc).__name__}: {exc}"
    if not record.success:
        logger.debug("request_id=%s failed: %s", record.request_id, record.error)
    if bar is not None:
        bar.update(1)


async def run_load(requests: Sequence[BenchRequest], endpoint: EndpointConfig, load: LoadConfig,
                   progress: bool = True) -> RunResult:
    run_id = uuid.uuid4().hex[:8]   # request ids stay unique across runs against one server
    records = [RequestRecord(f"bench-{run_id}-{i}", r.prompt_len, r.max_tokens) for i, r in enumerate(requests)]
    max_in_flight = load.max_concurrency or len(requests)
    backend = make_backend(endpoint, max_in_flight)
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    arrivals = arrival_times_s(len(requests), load.request_rate, load.seed)
    tasks = []
    try:
        with _progress(len(requests), progress) as bar:
            t0 = time.perf_counter()
            for request, record, at in zip(requests, records, arrivals):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_one(backend, request, record, gate, bar)))
            await asyncio.gather(*tasks)
            duration_s = time.perf_counter() - t0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await backend.close()
    for record in records:
        record.start_s = max(0.0, record.start_s - t0) if record.start_s else 0.0
    return RunResult(records, duration_s)
