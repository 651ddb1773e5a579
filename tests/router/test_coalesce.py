"""Coalescing under backpressure: what arrives while the reader is busy comes out as one batch,
in order; an error comes after the events before it; close() runs the iterator's cleanup."""
from __future__ import annotations

import asyncio

import pytest

from router.coalesce import Coalescer


async def _from(queue: asyncio.Queue, cleanup: list[str]):
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        cleanup.append("closed")


def test_events_that_arrive_while_the_reader_is_busy_come_as_one_batch():
    async def main():
        queue, cleanup = asyncio.Queue(), []
        batches = Coalescer(_from(queue, cleanup))
        for item in (1, 2, 3):
            queue.put_nowait(item)
        await asyncio.sleep(0.01)                       # the reader is busy elsewhere meanwhile
        first = await batches.take()
        waiting = asyncio.ensure_future(batches.take())  # a reader that keeps up gets one at a time
        await asyncio.sleep(0.01)
        queue.put_nowait(4)
        second = await waiting
        queue.put_nowait(None)
        rest = [await batches.take(), await batches.take()]
        await batches.close()
        return first, second, rest, cleanup
    assert asyncio.run(main()) == ([1, 2, 3], [4], [[], []], ["closed"])


def test_an_error_comes_after_the_events_before_it():
    async def main():
        queue, cleanup = asyncio.Queue(), []
        for item in (1, 2, ValueError("decode stream broke")):
            queue.put_nowait(item)
        batches = Coalescer(_from(queue, cleanup))
        await asyncio.sleep(0.01)
        got = await batches.take()
        with pytest.raises(ValueError, match="decode stream broke"):
            await batches.take()
        await batches.close()
        return got, cleanup
    assert asyncio.run(main()) == ([1, 2], ["closed"])


def test_close_cancels_the_reading_and_runs_the_iterators_cleanup():
    async def main():
        queue, cleanup = asyncio.Queue(), []
        batches = Coalescer(_from(queue, cleanup))
        queue.put_nowait(1)
        got = await batches.take()
        await batches.close()                            # the iterator waits on an empty queue
        return got, cleanup, asyncio.all_tasks() - {asyncio.current_task()}
    assert asyncio.run(main()) == ([1], ["closed"], set())
