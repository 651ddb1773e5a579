"""The worker engine thread: commands run between steps, results reach asyncio, crashes and
shutdown are visible."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine.serving.loop import EngineLoop


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

    def on_crash(self, exc: BaseException) -> None:
        self.crashed = exc


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
