"""deploy.bench.runner: seeded Poisson arrivals and the concurrency cap, with a fake backend."""
from __future__ import annotations

import asyncio
import math

import numpy as np

from deploy.bench import runner
from deploy.bench.config import EndpointConfig, LoadConfig
from deploy.bench.datasets import BenchRequest


def test_arrivals_are_seeded_exponential_gaps():
    times = runner.arrival_times_s(4000, request_rate=50.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    assert times == runner.arrival_times_s(4000, request_rate=50.0, seed=3)
    assert times != runner.arrival_times_s(4000, request_rate=50.0, seed=4)
    gaps = np.diff(times)
    assert abs(gaps.mean() - 1 / 50) < 0.1 / 50         # mean gap is 1 / rate
    assert abs(gaps.std() - 1 / 50) < 0.1 / 50          # exponential: std == mean
    assert runner.arrival_times_s(5, request_rate=math.inf, seed=0) == [0.0] * 5


class _FakeBackend:
    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.closed = False

    async def send(self, request: BenchRequest, record) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        record.start_s = runner.time.perf_counter()
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        if request.prompt == "boom":
            raise RuntimeError("backend bug")
        record.success, record.output_len, record.ttft_s, record.e2e_s = True, request.max_tokens, 0.005, 0.01

    async def close(self) -> None:
        self.closed = True


def test_concurrency_cap_and_unexpected_errors(monkeypatch):
    fake = _FakeBackend()
    monkeypatch.setattr(runner, "make_backend", lambda endpoint, max_connections: fake)
    requests = [BenchRequest("boom" if i == 5 else "p", 3, 2) for i in range(12)]
    result = asyncio.run(runner.run_load(requests, EndpointConfig(), LoadConfig(max_concurrency=3), progress=False))
    assert fake.max_in_flight == 3 and fake.closed
    assert [r.success for r in result.records] == [i != 5 for i in range(12)]
    assert result.records[5].error == "RuntimeError: backend bug"
    assert len({r.request_id for r in result.records}) == 12
    assert all(0.0 <= r.start_s <= result.duration_s for r in result.records)
    # four waves of three requests, 10 ms each
    assert result.duration_s >= 0.04
    assert sorted(r.start_s for r in result.records)[3] >= 0.01 - 1e-3


def test_poisson_rate_spreads_sends(monkeypatch):
    fake = _FakeBackend()
    monkeypatch.setattr(runner, "make_backend", lambda endpoint, max_connections: fake)
    requests = [BenchRequest("p", 3, 2) for _ in range(5)]
    result = asyncio.run(runner.run_load(requests, EndpointConfig(), LoadConfig(request_rate=100.0, seed=1),
                                         progress=False))
    expected = runner.arrival_times_s(5, 100.0, 1)
    # never early; late only by scheduling delay (generous: the test machine is shared)
    assert all(at - 0.002 <= r.start_s <= at + 0.25 for r, at in zip(result.records, expected))
    assert expected[-1] > 0.01
