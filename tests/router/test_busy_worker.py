"""Liveness is not load: a worker whose engine is held in a 10 s step, under streams, is never
removed and no request fails or fails over (docs/architecture.md, Liveness).

Real worker processes (one of them tests/router/slow_step_worker.py) behind an in-process router
whose heartbeat is far shorter than the step: 0.2 s polls with a 0.5 s timeout.
"""
from __future__ import annotations

import sys
import threading
import time

import openai
import pytest

from deploy.launch import ServiceProcess, WorkerProcess
from engine.tokenizer import Tokenizer
from router.config import RouterConfig
from router.server import Router
from worker.process import READY_PREFIX

pytestmark = pytest.mark.slow
HOLD_S = 10.0
FLAGS = ["--port", "0", "--metrics-port", "-1", "--dtype", "float32", "--device", "cpu", "--num-threads", "1",
         "--num-gpu-blocks-override", "256", "--block-size", "16"]


def _start(role: str, model, log_dir, hold_at: int | None) -> ServiceProcess:
    log = open(log_dir / f"{role}.stderr", "wb")  # noqa: SIM115 - the child writes it until it ends
    flags = ["--model", str(model), *FLAGS]
    env = {"OMP_NUM_THREADS": "1"}
    if hold_at is None:
        return WorkerProcess(role, flags, stderr=log, env=env)
    proc = ServiceProcess(f"slow {role} worker", [sys.executable, "-m", "tests.router.slow_step_worker", role,
                                                  str(hold_at), str(HOLD_S), *flags], READY_PREFIX,
                          stderr=log, env=env)
    proc.wait_ready(120)
    return proc


@pytest.mark.parametrize("slow_role", ["prefill", "decode"])
def test_a_worker_held_in_a_10_s_step_is_not_removed_and_no_request_fails(slow_role, tiny_model_dir,
                                                                          tmp_path, loop_thread):
    model = tiny_model_dir("llama")
    # The decode worker holds a step once its streams are running; the prefill worker holds its
    # first prompt step, with every request queued behind it.
    hold_at = {"prefill": 1, "decode": 6}[slow_role]
    workers = {role: _start(role, model, tmp_path, hold_at if role == slow_role else None)
               for role in ("prefill", "decode")}
    try:
        config = RouterConfig(model=str(model), served_model_name="tiny", http_port=0, grpc_port=0,
                              prefill=(workers["prefill"].info["grpc"],), decode=(workers["decode"].info["grpc"],),
                              heartbeat_interval_s=0.2, heartbeat_timeout_s=0.5, max_missed_heartbeats=1)
        removed: list[str] = []

        async def start():
            router = await Router(config, Tokenizer.from_model(str(model))).start()
            router.registry.on_removed(lambda w: removed.append(w.address))
            await router.registry.wait_healthy("prefill", 1)
            await router.registry.wait_healthy("decode", 1)
            return router
        router = loop_thread.run(start())
        try:
            client = openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="x", max_retries=0,
                                   timeout=120)
            counts: list[int | None] = [None] * 8
            errors: list[BaseException] = []

            def one(i: int) -> None:
                try:
                    stream = client.completions.create(model="tiny", prompt=f"Request {i} says", max_tokens=24,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True})
                    for chunk in stream:
                        if chunk.usage:
                            counts[i] = chunk.usage.completion_tokens
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            started = time.monotonic()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(counts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            elapsed = time.monotonic() - started
        finally:
            failovers = router.metrics.failovers._value.get()
            loop_thread.run(router.stop())
    finally:
        for w in workers.values():
            w.stop()
    log = (tmp_path / f"{slow_role}.stderr").read_text()
    assert f"holding step {hold_at} for {HOLD_S}" in log      # the hold really happened ...
    assert elapsed >= HOLD_S                                   # ... while the streams were open
    assert errors == []
    assert counts == [24] * 8
    assert removed == [] and failovers == 0
