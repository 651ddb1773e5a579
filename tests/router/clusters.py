"""The router tests' clusters: an asyncio loop on a thread, a router over fake workers or over real
worker processes, and the two ways tests drive them.

The router and the fake workers (tests/router/fake_workers.py, the in-process twins of the worker
processes) run on one background loop, so the tests can drive them with blocking clients
(openai, httpx, TandemClient) exactly as users do: ``fake_cluster_running`` for a module's
cluster, ``run(loop_thread, tokenizer, body)`` for a coroutine against a cluster of its own, and
``until`` to wait on a condition inside one. ``real_cluster`` puts the router in front of real
worker processes instead. The fixtures (``loop_thread``, ``tokenizer``, ``fake_cluster``) are in
tests/router/conftest.py.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from deploy.launch import WorkerProcess
from engine.tokenizer import Tokenizer
from router.config import RouterConfig
from router.server import Router
from tests.router.fake_workers import FakeWorker

MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 180.0   # real workers loading side by side on 2 cores (SmolLM2: ~15 s each alone)


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.run(drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class FakeCluster:
    router: Router
    prefills: list[FakeWorker] = field(default_factory=list)
    decodes: list[FakeWorker] = field(default_factory=list)

    @property
    def http(self) -> str:
        return f"http://{self.router.http_address}"

    @property
    def workers(self) -> list[FakeWorker]:
        return self.prefills + self.decodes


async def start_fake_cluster(tokenizer: Tokenizer, num_prefill: int = 1, num_decode: int = 1,
                             decode_options: dict | None = None, **router_options) -> FakeCluster:
    prefills = [await FakeWorker("prefill").start() for _ in range(num_prefill)]
    decodes = [await FakeWorker("decode", **(decode_options or {})).start() for _ in range(num_decode)]
    config = RouterConfig(model=MODEL, http_port=0, grpc_port=0, prefill=tuple(w.address for w in prefills),
                          decode=tuple(w.address for w in decodes), heartbeat_interval_s=0.2,
                          heartbeat_timeout_s=1.0, **router_options)
    router = await Router(config, tokenizer).start()
    await router.registry.wait_healthy("prefill", num_prefill)
    await router.registry.wait_healthy("decode", num_decode)
    return FakeCluster(router, prefills, decodes)


async def stop_fake_cluster(cluster: FakeCluster) -> None:
    await cluster.router.stop()
    for worker in cluster.workers:
        await worker.stop()


@contextmanager
def fake_cluster_running(loop_thread: LoopThread, tokenizer: Tokenizer, **options) -> Iterator[FakeCluster]:
    """A module fixture's body: ``start_fake_cluster(tokenizer, **options)``, stopped afterwards."""
    cluster = loop_thread.run(start_fake_cluster(tokenizer, **options))
    try:
        yield cluster
    finally:
        loop_thread.run(stop_fake_cluster(cluster))


def run(loop_thread: LoopThread, tokenizer: Tokenizer, body, timeout_s: float = 60.0, **cluster_options):
    """``await body(cluster)`` on the loop thread, against a fake cluster of its own."""
    async def main():
        cluster = await start_fake_cluster(tokenizer, **cluster_options)
        try:
            return await body(cluster)
        finally:
            await stop_fake_cluster(cluster)
    return loop_thread.run(main(), timeout_s)


async def until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


class RealWorker(WorkerProcess):
    """A real worker process (float32, 1 thread, 16-token blocks) logging to ``log_dir``;
    ``wait=False`` returns once it is spawned (``wait_ready`` then), so several load at once."""

    def __init__(self, role: str, model: Path, log_dir: Path, *flags: str, wait: bool = True) -> None:
        self.log = open(log_dir / f"{role}-{time.monotonic_ns()}.stderr", "wb")  # noqa: SIM115 - closed by stop
        super().__init__(role, ["--model", str(model), "--port", "0", "--metrics-port", "0", "--dtype", "float32",
                                "--device", "cpu", "--num-threads", "1", "--block-size", "16", "--kv-lease-s", "3",
                                *flags], stderr=self.log, env={"OMP_NUM_THREADS": "1"}, wait=wait)

    @property
    def address(self) -> str:
        return self.grpc

    def stop(self) -> int:
        code = super().stop(15)
        self.log.close()
        return code


def real_cluster(loop_thread: LoopThread, model: Path, roles: tuple[str, ...], log_dir: Path, name: str,
                 *worker_flags: str, **router_options) -> Iterator[tuple[Router, dict[str, list[RealWorker]]]]:
    """A module fixture's body: one RealWorker per entry of ``roles`` and a router (served as
    ``name``, RouterConfig's ``router_options`` on top) in front of them, once all are healthy;
    everything is stopped afterwards."""
    workers: dict[str, list[RealWorker]] = {"prefill": [], "decode": []}
    try:
        for role in roles:   # all spawned first: their models load side by side
            workers[role].append(RealWorker(role, model, log_dir, *worker_flags, wait=False))
        for worker in workers["prefill"] + workers["decode"]:
            worker.wait_ready(START_TIMEOUT_S)
        config = RouterConfig(model=str(model), served_model_name=name, http_port=0, grpc_port=0,
                              prefill=tuple(w.address for w in workers["prefill"]),
                              decode=tuple(w.address for w in workers["decode"]),
                              heartbeat_interval_s=0.3, heartbeat_timeout_s=1.0, **router_options)

        async def start() -> Router:
            router = await Router(config, Tokenizer.from_model(str(model))).start()
            await router.registry.wait_healthy("prefill", len(workers["prefill"]))
            await router.registry.wait_healthy("decode", len(workers["decode"]))
            return router
        router = loop_thread.run(start())
        yield router, workers
        loop_thread.run(router.stop())
    finally:
        for w in workers["prefill"] + workers["decode"]:
            w.stop()
