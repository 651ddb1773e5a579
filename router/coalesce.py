"""Coalescing of a stream's events under backpressure (router process, on its asyncio loop).

``Coalescer(events)`` reads an async iterator on its own task; ``take()`` returns every event
that arrived since the last call (waiting for the first one). While the caller is busy writing
the previous chunk to a slow client, the decode worker's messages pile up here and leave as one
batch: one detokenize, one chunk, one outgoing message for all of them instead of one each. A
caller that keeps up gets one event per batch, so coalescing adds no latency.

An error raised by the iterator is re-raised by ``take()`` after the events before it. ``close()``
cancels the reading task and waits for it, so the iterator's cleanup (aborting the request at the
workers) has run when it returns.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Coalescer(Generic[T]):
    def __init__(self, events: AsyncIterator[T]) -> None:
        self._events = events
        self._ready: list[T] = []
        self._error: BaseException | None = None
        self._ended = False
        self._waiter: asyncio.Future | None = None
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            async for event in self._events:
                self._ready.append(event)
                self._wake()
        except asyncio.CancelledError as exc:
            if asyncio.current_task().cancelling():
                raise                 # close()
            self._error = exc         # the iterator's own (a cancelled call): the reader gets it
        except Exception as exc:  # noqa: BLE001 - handed to the reader in take()
            self._error = exc
        finally:
            self._ended = True
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[T]:
        """Every event that arrived since the last call; [] once the iterator has ended."""
        while not self._ready:
            if self._ended:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                return []
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch, self._ready = self._ready, []
        return batch

    async def close(self) -> None:
        if self._task.done():     # the usual case: the stream ended with its finish event
            return
        self._task.cancel()
        # Not gather(): a cancellation of the caller while it waits here must still reach it.
        await asyncio.wait([self._task])
