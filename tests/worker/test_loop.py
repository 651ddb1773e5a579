"""The worker engine thread: commands run between steps, results reach asyncio, crashes and
shutdown are visible."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from worker.loop import EngineLoop


class CountingLoop(EngineLoop):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__("test-engine", log_interval_s=60)
        self.steps = 0
        self.fail_at = fail_at
        self.crashed: BaseException | None = None

    def run_once(self) -> bool:
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("boom")
        return self.steps < 5

    def stats(self) -> dict:
        return {"steps": self.steps}

    def on_crash(self, exc: BaseException) -> None:
        self.crashed = exc


class BlockingLoop(CountingLoop):
    """A step that holds the engine thread until released (a long prefill)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_step = threading.Event()
        self.release = threading.Event()

    def run_once(self) -> bool:
        self.steps += 1
        if self.steps == 2:
            self.in_step.set()
            self.release.wait(30)
        return True


def test_commands_run_on_the_engine_thread_and_results_reach_asyncio():
    loop = CountingLoop()
    loop.start()
    try:
        async def main():
            assert await loop.run(lambda: 6 * 7) == 42
            with pytest.raises(KeyError, match="nope"):
                await loop.run(lambda: {}["nope"])
        asyncio.run(main())
    finally:
        loop.stop()
    assert not loop.alive and loop.steps >= 1


def test_a_crash_is_recorded_and_later_calls_fail_clearly():
    loop = CountingLoop(fail_at=2)
    loop.start()
    deadline = time.monotonic() + 10
    while loop.alive:
        assert time.monotonic() < deadline
        loop.call(lambda: None)
        time.sleep(0.01)
    assert isinstance(loop.error, RuntimeError) and loop.crashed is loop.error

    async def main():
        with pytest.raises(RuntimeError, match="engine thread is not running"):
            await loop.run(lambda: 1)
    asyncio.run(main())


def test_stats_snapshot_is_answered_while_a_step_holds_the_engine_thread():
    loop = BlockingLoop()
    assert loop.stats() == {"steps": 0}
    loop.start()
    try:
        assert loop.in_step.wait(10)
        time.sleep(0.2)
        # The step holds the engine thread until `release` is set below: a snapshot that waited
        # for it would never return.
        got: list = []
        asker = threading.Thread(target=lambda: got.append(loop.snapshot()), daemon=True)
        asker.start()
        asker.join(10)
        assert got == [{"steps": 1}]               # published after step 1, before step 2 began
        assert loop.snapshot_age_s >= 0.2
        assert loop.alive
    finally:
        loop.release.set()
        loop.stop()
    with pytest.raises(RuntimeError, match="engine thread is not running"):
        loop.snapshot()


class ThreadsLoop(CountingLoop):
    def __init__(self) -> None:
        super().__init__()
        self.torch_threads: int | None = None

    def run_once(self) -> bool:
        import torch
        self.torch_threads = torch.get_num_threads()
        return super().run_once()


def test_the_engine_thread_alone_runs_torch_on_num_threads():
    """libgomp gives each thread that opens a parallel region its own team: the engine thread
    gets the worker's threads, the thread that built the engine keeps its one."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    loop = ThreadsLoop()
    loop.num_threads = 3
    try:
        loop.start()
        for _ in range(500):
            if loop.torch_threads is not None:
                break
            time.sleep(0.01)
        assert loop.torch_threads == 3
        assert torch.get_num_threads() == 1
    finally:
        loop.stop()
        torch.set_num_threads(before)


def test_a_worker_builds_its_engine_on_one_thread():
    import signal

    import torch

    from worker import process
    seen = {}

    def build(worker, *configs):
        seen["threads"] = torch.get_num_threads()
        raise ValueError("stop after the build")

    before, handler = torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    try:
        assert process.run("decode", build, ["--num-threads", "3"]) == 2
    finally:
        torch.set_num_threads(before)
        signal.signal(signal.SIGTERM, handler)
    assert seen == {"threads": 1}
