"""One gRPC stream that carries many requests: the router's ``Session`` stream to each worker
(router/session.py) and the SDK's ``Tandem.Multiplex`` stream to the router (tandem_client/) are
both made of these parts.

- ``SessionStream``: one peer's stream. What is started or aborted in the same turn of the event
  loop leaves in one message (several, past FLUSH_BYTES); a task reads the answers and hands
  each to its request; when the stream breaks every request open on it fails with that error
  and the next request opens a new stream. Subclasses name the messages and route the answers.
- ``PendingMessages``: one request's messages as the reader delivers them, taken in batches
  (what arrived while the taker was busy comes at once), then its end or its error.
- ``refusal``: a request the peer refused or failed (an ``error_code`` in its answer) as the
  ``grpc.aio.AioRpcError`` a call of its own would have raised.
- ``Wakeup``: one task's sleep until code on the same loop has something for it; the writer and
  ``PendingMessages`` here, the workers' session handlers (worker/session.py) and the router's
  Multiplex handler (router/grpc_api.py) all wait on one.

Here, not in the router, so the SDK needs grpcio and protos only. Runs on the caller's asyncio
loop; nothing here is thread-safe.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from protos.limits import MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)
FLUSH_BYTES = MAX_MESSAGE_BYTES // 4   # prompts per message, well under the message limit
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class PeerFailure(grpc.aio.AioRpcError):
    """A request its peer failed or refused on a stream. ``transient`` (from a decode worker):
    the failure is not the request's own (its KV transfer broke), so it does not count toward
    the router dispatcher's "failed twice for the same reason"."""

    def __init__(self, code: grpc.StatusCode, details: str, transient: bool = False) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
        self.transient = transient


def refusal(error_code: int, error: str, transient: bool = False) -> grpc.aio.AioRpcError:
    return PeerFailure(_STATUS.get(error_code, grpc.StatusCode.UNKNOWN), error, transient)


class Wakeup:
    """One task sleeps in ``wait`` until another piece of code on the same loop calls ``wake``.
    A wake while nobody waits is not remembered (no ``clear`` to forget, unlike an
    ``asyncio.Event``), so the waiter checks for its work before each ``wait``, in a loop."""

    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future | None = None

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout_at: float | None = None) -> None:
        """Until the next ``wake()``; TimeoutError past ``timeout_at`` (a loop time)."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        try:
            if timeout_at is None:
                await waiter
            else:
                await asyncio.wait_for(waiter, timeout_at - loop.time())
        finally:
            if self._waiter is waiter:
                self._waiter = None


class SessionStream:
    """One peer's stream: batches what is started and aborted per turn of the loop, reads the
    answers on a task, and fails everything open when the stream breaks. Subclasses name the
    messages and route each answer to its request.

    "Session" is Tandem's one word for a long-lived stream that carries many requests: the
    workers' ``Session`` RPC (worker.proto), whose router end this is (router/session.py) and
    whose worker end is worker/session.py; the SDK's ``Multiplex`` stream is one too, under its
    public RPC name, so it subclasses this under the same name."""

    keyed = False                       # answers name their request by .key (else .request_id)
    closed_reason = "was removed"       # why requests fail after close()

    @property
    def peer(self) -> str:
        """Who is at the other end, as error messages name it."""
        return self.address

    def __init__(self, stub: Any, address: str) -> None:
        self._stub = stub
        self.address = address
        self._call: Any = None                # the open stream-stream call, or None
        self._open_requests: dict[Any, Any] = {}
        self._starts: list[Any] = []         # what the writer sends next
        self._aborts: list[Any] = []
        self._writer_idle = Wakeup()          # the writer waits on it for work
        self._writer: asyncio.Task | None = None   # the open call's writer (one of _tasks)
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    async def close(self) -> None:
        """End the stream; what is open on it fails UNAVAILABLE."""
        self._closed = True
        self._broken(self._removed())
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _removed(self) -> grpc.aio.AioRpcError:
        return rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.peer} {self.closed_reason}")

    # -- for subclasses ------------------------------------------------------------------
    def _new_call(self) -> Any:
        return self._stub.Session()

    def _message(self, starts: list[Any], aborts: list[Any]) -> Any:
        raise NotImplementedError

    def _answers(self, response: Any) -> Any:
        raise NotImplementedError

    def _deliver(self, target: Any, answer: Any) -> bool:
        """Hand ``answer`` to its request; True when that was the request's last."""
        raise NotImplementedError

    def _fail(self, target: Any, error: grpc.aio.AioRpcError) -> None:
        raise NotImplementedError

    async def _ready(self, call: Any) -> bool:
        """Whether to write on ``call``: it waits, where the peer says it is ready, for that."""
        return True

    def _start(self, request_id: Any, request: Any, target: Any) -> bool:
        """Queue ``request``; False (``target`` already failed) when the session is closed."""
        if self._closed:
            self._fail(target, self._removed())
            return False
        if self._call is None:
            self._open()
        self._open_requests[request_id] = target
        self._starts.append(request)
        self._writer_idle.wake()
        return True

    def _abort(self, request_id: Any) -> None:
        if self._closed:
            return
        if self._call is None:
            self._open()
        self._aborts.append(request_id)
        self._writer_idle.wake()

    # -- the stream ---------------------------------------------------------------------
    def _open(self) -> None:
        call = self._call = self._new_call()
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write(call))
        self._tasks = [self._writer, loop.create_task(self._read(call))]

    def _messages(self, starts: list[Any], aborts: list[Any]) -> list[Any]:
        """``starts`` and ``aborts`` as messages: one, or several when the prompts add up to
        more than FLUSH_BYTES; the aborts go last, since one of them may stop a request just started."""
        if len(starts) <= 1:
            return [self._message(starts, aborts)]
        messages: list[Any] = []
        batch: list[Any] = []
        size = 0
        for request in starts:
            request_size = request.ByteSize()
            if batch and size + request_size > FLUSH_BYTES:
                messages.append(self._message(batch, []))
                batch, size = [], 0
            batch.append(request)
            size += request_size
        messages.append(self._message(batch, aborts))
        return messages

    async def _write(self, call: Any) -> None:
        """Send what was started and aborted, in order: everything queued since the writer last
        ran leaves together, so what a turn of the loop starts is one message, and so is what
        queued up while a write was on the wire. The writer is woken by the first start or
        abort of a turn and runs in the next, before work that turn scheduled after it."""
        try:
            if not await self._ready(call):
                return              # the reader sees how the stream ended
            while self._call is call:
                if not self._starts and not self._aborts:
                    await self._writer_idle.wait()
                    continue
                starts, aborts, self._starts, self._aborts = self._starts, self._aborts, [], []
                for message in self._messages(starts, aborts):
                    await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            logger.debug("session to %s: write failed: %s", self.address, exc)   # the reader sees the break

    async def _read(self, call: Any) -> None:
        open_requests = self._open_requests
        try:
            async for response in call:
                for answer in self._answers(response):
                    key = answer.key if self.keyed else answer.request_id
                    target = open_requests.get(key)
                    if target is not None and self._deliver(target, answer):
                        del open_requests[key]
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.peer} ended the session")
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the session to {self.peer} closed")
        if self._call is call:
            self._broken(error)

    def _broken(self, error: grpc.aio.AioRpcError) -> None:
        """The stream is gone: fail every open request with ``error``; the next request reopens."""
        call, self._call = self._call, None
        # The writer has nothing left to send, so it ends now. It may be inside call.write:
        # grpc's write first waits until the call's headers went out, and a call cancelled before
        # its connection came up (a peer just killed, or frozen) never sends them nor wakes that
        # wait, so without this close() would wait for it forever (tests/router/test_session_close.py).
        if self._writer is not None:
            self._writer.cancel()
        if call is not None:
            call.cancel()
        open_requests, self._open_requests = self._open_requests, {}
        self._starts, self._aborts = [], []
        for target in open_requests.values():
            self._fail(target, error)


class PendingMessages:
    """One request's messages as its stream's reader delivers them, handed over in batches, then
    its end or its error. The reader's side is ``_ready`` / ``_end`` / ``_wake``."""

    __slots__ = ("_ready", "_error", "_ended", "_cancelled", "_wakeup")

    def __init__(self) -> None:
        self._ready: list[Any] = []
        self._error: BaseException | None = None
        self._ended = False            # the last message (or an error) arrived
        self._cancelled = False
        self._wakeup = Wakeup()

    async def take(self, timeout_at: float | None = None) -> list[Any]:
        """Every message that arrived since the last call (waits for one); [] once the request
        ended. What piled up while the caller was busy (writing to a slow client) comes as one
        batch: the router coalesces a request's tokens here. Raises the request's error,
        CancelledError once cancelled, TimeoutError past ``timeout_at`` (a loop time)."""
        if not await self._wait_ready(timeout_at):
            return []
        ready, self._ready = self._ready, []
        return ready

    async def _wait_ready(self, timeout_at: float | None = None) -> bool:
        """Until a message is ready (True) or the request ended (False)."""
        while not self._ready:
            if self._cancelled:
                raise asyncio.CancelledError()
            if self._error is not None:
                raise self._error
            if self._ended:
                return False
            await self._wakeup.wait(timeout_at)
        return True

    def _end(self, error: BaseException) -> None:
        if not self._ended:
            self._error, self._ended = error, True
            self._wake()

    def _wake(self) -> None:
        self._wakeup.wake()
