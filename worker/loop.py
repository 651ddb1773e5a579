"""The engine thread of a worker: runs the role's step loop; other threads hand it commands.

gRPC handlers (on the asyncio thread) never touch engine state: they ``call`` a function on
this thread, which runs it between steps. Stoppable; ``stop`` joins the thread.

Liveness is not load: after every step and command batch the thread publishes ``stats()`` as an
immutable snapshot, and ``Stats``/health read that snapshot without waiting on the thread, so a
10 s prefill step never makes a busy worker look dead (docs/architecture.md, Liveness).

Torch's CPU threads belong to this thread alone (``num_threads``): libgomp gives every thread
that opens a parallel region its own team, and once a process has more team threads than cores
it cuts every spin-wait to ~100 iterations, so a worker whose main thread built the engine with
N threads and whose engine thread then ran it with N more waited at every barrier (measured on 2
cores, SmolLM2 colocated at 16 streams, 2 threads: 352 output tok/s and 1.48 cores busy, against
487 and 1.99 with one team). The worker process builds the engine with one thread and this
thread sets ``num_threads`` when it starts.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


class EngineLoop(abc.ABC):
    def __init__(self, name: str, log_interval_s: float) -> None:
        self._commands: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._log_interval_s = log_interval_s
        self._next_log = time.monotonic() + log_interval_s
        self.error: BaseException | None = None
        self.num_threads = 0   # torch CPU threads of this thread (0: leave torch's setting)
        self.bind_threads = False   # bind those threads one to a CPU (a CPU engine's, WorkerConfig)
        self._snapshot: dict[str, Any] = {}
        self._snapshot_at = 0.0

    def start(self) -> None:
        self._publish()   # the thread is not running yet: safe to read engine state here
        self._thread.start()

    def snapshot(self) -> dict[str, Any]:
        """The last ``stats()`` the engine thread published (any thread; never waits on a step).
        RuntimeError once the engine thread is gone: a dead engine is not a busy one."""
        if not self.alive:
            raise RuntimeError(f"the engine thread is not running ({self.error!r})")
        return self._snapshot

    @property
    def snapshot_age_s(self) -> float:
        return time.monotonic() - self._snapshot_at

    def _publish(self) -> None:
        # One reference assignment: readers on other threads see the old dict or the new one.
        self._snapshot, self._snapshot_at = self.stats(), time.monotonic()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the engine thread before its next step (what it returns is dropped)."""
        self._commands.put(fn)
        self._wake.set()

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread and await its result (or exception) on asyncio."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def call() -> None:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        self.call(call)
        return await fut

    def _run(self) -> None:
        try:
            if self.num_threads:
                import torch
                torch.set_num_threads(self.num_threads)
                if self.bind_threads:
                    self._bind_threads()
            while not self._stopping.is_set():
                while True:
                    try:
                        fn = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    fn()
                busy = self.run_once()
                self._publish()
                now = time.monotonic()
                if now >= self._next_log:
                    self.log_stats(now)
                    self._next_log = now + self._log_interval_s
                if not busy:
                    self._wake.wait(self.idle_wait_s())
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - surfaced through health and logs
            self.error = exc
            logger.exception("engine thread died")
            self.on_crash(exc)

    def _bind_threads(self) -> None:
        from engine.models import cpu_ops
        ops = cpu_ops.load()
        cpus = ops.bind_threads(self.num_threads) if ops is not None else []
        if cpus:
            logger.info("engine thread's %d torch threads bound to CPUs %s", self.num_threads, cpus)
        else:
            logger.info("engine thread's %d torch threads not bound to CPUs (bound only when there is one for "
                        "each of the %d CPUs the worker may use, and the layer-ops library loads)", self.num_threads,
                        len(os.sched_getaffinity(0)))

    @abc.abstractmethod
    def run_once(self) -> bool:
        """One step of work; False when there was nothing to do."""

    def idle_wait_s(self) -> float:
        return 0.05

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Load and capacity as the Stats RPC reports them (engine thread; cheap: every step)."""

    def log_stats(self, now: float) -> None:
        """Called every ``log_interval_s`` on the engine thread."""

    def on_crash(self, exc: BaseException) -> None:
        """Called on the engine thread after an unexpected error ended the loop."""
