"""`tandem serve --engine sim --planner` for real: a prompt load one prefill worker cannot carry
within the TTFT SLO makes the planner add a prefill replica; when the load falls it gives it back;
nothing flaps in between (the controller's log has exactly those two changes)."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.serving import all_pids, assert_nothing_left, interrupt, start_serve
from tests.engine.sim.profiles import profile_rows

pytestmark = pytest.mark.slow
PREFILL_TOK_PER_S = 4000.0      # the profile's: one prefill worker computes a 400-token prompt in 0.1 s
PROMPT_TOKENS = 400
HIGH_RATE, LOW_RATE = 12.0, 1.0  # requests/s: 4800 prompt tok/s (1.2x one worker, 0.6x two), then 400
CHANGE = re.compile(r"planner: (?:dry run, not applied: )?prefill (\d+) -> (\d+), decode (\d+) -> (\d+)")


class Load(threading.Thread):
    """Requests at ``rate`` per second, each a fresh prompt (no prefix-cache hits), until stopped."""

    def __init__(self, http: str, model: str, rate: float, first_id: int) -> None:
        super().__init__(daemon=True)
        self.http, self.model, self.rate, self.next_id = http, model, rate, first_id
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.start()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _one(self, client: httpx.AsyncClient, request_id: int) -> None:
        prompt = [100 + request_id % 40000] + [1000 + (request_id * 31 + i) % 30000 for i in range(PROMPT_TOKENS - 1)]
        body = {"model": self.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        self.statuses.append(response.status_code)

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=50)
        async with httpx.AsyncClient(base_url=self.http, timeout=60, limits=limits) as client:
            tasks, start = [], time.monotonic()
            while not self.stop.is_set() and time.monotonic() - start < 120:
                tasks.append(asyncio.create_task(self._one(client, self.next_id)))
                self.next_id += 1
                await asyncio.sleep(max(0.0, start + len(tasks) / self.rate - time.monotonic()))
            await asyncio.gather(*tasks)

    def finish(self) -> list[int]:
        self.stop.set()
        self.join(90)
        return self.statuses


def changes(log: Path) -> list[tuple[int, int, int, int]]:
    return [tuple(map(int, m.groups())) for m in CHANGE.finditer(log.read_text(errors="replace"))]


def wait_for(log: Path, pattern: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, log.read_text(errors="replace")):
        if time.monotonic() > deadline:
            pytest.fail(f"no {pattern!r} within {timeout_s:.0f} s; planner changes {changes(log)}")
        time.sleep(0.5)


def test_planner_adds_a_prefill_replica_under_load_and_gives_it_back(tmp_path):
    profile = tmp_path / "slow_prefill.json"
    profile.write_text(json.dumps(profile_rows(2.0, 0.05, 0.001, PREFILL_TOK_PER_S, kv_cache_tokens=65536)))
    dep = start_serve(tmp_path / "serve", "--engine", "sim", "--sim-profile", str(profile), "--prefill", "1",
                      "--decode", "1", "--max-model-len", "1024", "--local-prefill-max-tokens", "0",
                      # The default prefill policy (cache_aware): every prompt is new, so each is a
                      # miss and must go to the least loaded replica, not all to the new one.
                      "--planner", "--ttft-slo-ms", "500", "--itl-slo-ms", "200", "--max-workers", "4",
                      "--planner-interval-s", "1", "--prometheus-sd-file", str(tmp_path / "targets.json"))
    log = dep.log
    pids: list[int] = []
    try:
        status = dep.status()
        pids = all_pids(status)
        assert status["planner"]["max_workers"] == 4 and not status["planner"]["dry_run"]
        model = f"sim:{profile}"

        high = Load(dep.http, model, HIGH_RATE, 0)
        try:
            wait_for(log, r"planner: prefill 1 -> 2", 40)
            wait_for(log, r"prefill worker prefill-1 is serving", 40)
            time.sleep(8)                    # two workers carry it: no third, nothing given back
        finally:
            statuses = high.finish()
        assert changes(log) == [(1, 2, 1, 1)]

        low = Load(dep.http, model, LOW_RATE, 100000)
        try:
            wait_for(log, r"planner: prefill 2 -> 1", 45)
            time.sleep(4)
        finally:
            statuses += low.finish()
        assert changes(log) == [(1, 2, 1, 1), (2, 1, 1, 1)]
        assert len(statuses) > 100 and set(statuses) == {200}

        status = dep.status()
        pids += all_pids(status)
        assert status["desired"] == {"prefill": 1, "decode": 1}
        metrics = httpx.get(f"http://{status['planner']['metrics']}/metrics").text
        assert 'tandem_planner_target_replicas{role="prefill"} 1.0' in metrics
        assert "planner: TTFT SLO 500 ms, ITL SLO 200 ms, max 4 workers" in dep.cli("status").stdout
        targets = json.loads((tmp_path / "targets.json").read_text())
        assert [g["targets"] for g in targets if g["labels"]["role"] == "planner"] == [[status["planner"]["metrics"]]]
    finally:
        interrupt(dep.proc)
    assert dep.proc.returncode == 0, dep.log_tail()
    assert_nothing_left(pids)
