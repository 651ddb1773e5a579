"""The bookkeeping both workers' ``Session`` handlers share (asyncio thread).

A Session stream (worker.proto) carries many of the router's requests: a reader task takes the
router's messages as they come, structured-output grammars compile off the engine thread while
the rest of the stream goes on, and the handler's writer loop sleeps until there is something
to send. ``SessionState`` holds that: the reader, the compiles in flight, the writer's wake-up.
The decode and prefill servicers keep what differs (what they buffer and how they answer).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from protos.streams import Wakeup


class SessionState:
    """A worker's end of one Session stream (the router's end: router/session.py's ``WorkerSession``)."""

    def __init__(self) -> None:
        self.reading = True                 # the router has not closed its side yet
        self._reader: asyncio.Task | None = None
        self._wakeup = Wakeup()              # the handler's writer sleeps on it
        self._compiling: set[asyncio.Task] = set()

    def read(self, messages: AsyncIterator[Any], handle: Callable[[Any], None]) -> None:
        """Call ``handle`` with each of the router's messages, on a task of its own."""
        async def run() -> None:
            try:
                async for message in messages:
                    handle(message)
            finally:
                self.reading = False
                self.wake()
        self._reader = asyncio.get_running_loop().create_task(run())

    def compile_then(self, compile_grammar: Callable[[Any], object], structured: Any, then: Callable[[], None],
                     refuse: Callable[[str], None]) -> None:
        """``compile_grammar(structured)`` (the engine's) off the engine thread, then
        ``then()``; ``refuse(why)`` when it does not compile (INVALID_ARGUMENT)."""
        async def run() -> None:
            try:
                await asyncio.to_thread(compile_grammar, structured)
            except ValueError as exc:
                refuse(str(exc))
                return
            then()
        task = asyncio.get_running_loop().create_task(run())
        self._compiling.add(task)
        task.add_done_callback(self._compiling.discard)

    def wake(self) -> None:
        self._wakeup.wake()

    async def wait(self) -> None:
        """Until the next ``wake()``."""
        await self._wakeup.wait()

    def check(self) -> None:
        """Re-raise what broke the reader (the stream itself: the handler ends)."""
        reader = self._reader
        if reader is not None and reader.done() and not reader.cancelled():
            error = reader.exception()
            if error is not None:
                raise error

    def close(self) -> None:
        """Stop reading and compiling (the handler is ending)."""
        for task in [self._reader, *self._compiling]:
            if task is not None:
                task.cancel()
