"""The router's data plane to its workers: one long-lived ``Session`` stream per worker.

Every request the router sends to a worker travels on the one stream it keeps open to that
worker, instead of a call of its own: what is started or aborted in the same turn of the event
loop leaves in one message, and a decode worker's engine step brings the tokens of all of them
back in one message. Per request that saves the gRPC calls (HTTP/2 stream set-up, metadata, a
completion-queue round per message); per token, a message.

- ``DecodeSession.generate`` returns a ``SessionCall``, which the dispatcher uses as it would a
  ``DecodeWorker.Generate`` call: iterate it for ``GenerateResponse`` messages, ``cancel()`` it
  (the worker is told to abort the request), ``done()``.
- ``PrefillSession.submit`` is ``PrefillWorker.Submit``: it returns a future of the
  ``SubmitResponse``; ``abort`` is ``PrefillWorker.Abort`` without an answer.

A request the worker refuses or fails ends with ``grpc.aio.AioRpcError`` carrying the worker's
status code. When a stream breaks (the worker died, the connection dropped, the registry removed
the worker) every request open on it ends with that error and the next request opens a new
stream; the worker frees what was open on a decode stream that broke.

Runs on the router's asyncio loop; nothing here is thread-safe.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from protos.limits import MAX_MESSAGE_BYTES
from protos.tandem.v1 import worker_pb2

logger = logging.getLogger(__name__)
FLUSH_BYTES = MAX_MESSAGE_BYTES // 4   # prompts per message, well under the message limit
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class WorkerFailure(grpc.aio.AioRpcError):
    """A request a worker failed or refused on a session stream. ``transient``: the failure is not
    the request's own (its KV transfer broke), so it does not count toward the dispatcher's
    "failed twice for the same reason"."""

    def __init__(self, code: grpc.StatusCode, details: str, transient: bool = False) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
        self.transient = transient


def refusal(error_code: int, error: str, transient: bool = False) -> grpc.aio.AioRpcError:
    return WorkerFailure(_STATUS.get(error_code, grpc.StatusCode.UNKNOWN), error, transient)


class SessionStream:
    """One peer's stream: batches what is started and aborted per turn of the loop, reads the
    answers on a task, and fails everything open when the stream breaks. Subclasses name the
    messages and route each answer to its request (the SDK's multiplexed stream to the router,
    router/client.py, is one too)."""

    role = ""
    keyed = False                       # answers name their request by .key (else .request_id)
    closed_reason = "was removed"       # why requests fail after close()

    @property
    def peer(self) -> str:
        return f"{self.role} worker {self.address}"

    def __init__(self, stub: Any, address: str) -> None:
        self._stub = stub
        self.address = address
        self._call: Any = None                # the open stream-stream call, or None
        self._open_requests: dict[Any, Any] = {}
        self._starts: list[Any] = []         # what the writer sends next
        self._aborts: list[Any] = []
        self._writer_idle: asyncio.Future | None = None   # the writer waits on it for work
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
        self._wake_writer()
        return True

    def _abort(self, request_id: Any) -> None:
        if self._closed:
            return
        if self._call is None:
            self._open()
        self._aborts.append(request_id)
        self._wake_writer()

    # -- the stream ---------------------------------------------------------------------
    def _wake_writer(self) -> None:
        waiter = self._writer_idle
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _open(self) -> None:
        call = self._call = self._new_call()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write(call)), loop.create_task(self._read(call))]

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
        loop = asyncio.get_running_loop()
        try:
            if not await self._ready(call):
                return              # the reader sees how the stream ended
            while self._call is call:
                if not self._starts and not self._aborts:
                    waiter = self._writer_idle = loop.create_future()
                    await waiter
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
        self._wake_writer()      # it sees the stream gone and ends
        if call is not None:
            call.cancel()
        open_requests, self._open_requests = self._open_requests, {}
        self._starts, self._aborts = [], []
        for target in open_requests.values():
            self._fail(target, error)


class PendingMessages:
    """One request's messages as its stream's reader delivers them, handed over in batches, then
    its end or its error. The reader's side is ``_ready`` / ``_end`` / ``_wake``."""

    __slots__ = ("_ready", "_error", "_ended", "_cancelled", "_waiter")

    def __init__(self) -> None:
        self._ready: list[Any] = []
        self._error: BaseException | None = None
        self._ended = False            # the last message (or an error) arrived
        self._cancelled = False
        self._waiter: asyncio.Future | None = None

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
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            try:
                if timeout_at is None:
                    await waiter
                else:
                    await asyncio.wait_for(waiter, timeout_at - loop.time())
            finally:
                self._waiter = None
        return True

    def _end(self, error: BaseException) -> None:
        if not self._ended:
            self._error, self._ended = error, True
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class SessionCall(PendingMessages):
    """One request's stream of ``GenerateResponse`` on a decode session; the twin of a
    unary-stream call (iterate, ``cancel()``, ``done()``)."""

    __slots__ = ("_session", "request_id")

    def __init__(self, session: DecodeSession, request_id: str) -> None:
        super().__init__()
        self._session = session
        self.request_id = request_id

    def __aiter__(self) -> SessionCall:
        return self

    async def __anext__(self) -> worker_pb2.GenerateResponse:
        if not await self._wait_ready():
            raise StopAsyncIteration
        return self._ready.pop(0)

    def done(self) -> bool:
        return self._ended or self._cancelled

    def cancel(self) -> bool:
        """Stop reading and have the worker abort the request (unless it already ended)."""
        if self.done():
            return False
        self._cancelled = True
        self._session._cancel(self)
        self._wake()
        return True

    def _put(self, response: worker_pb2.GenerateResponse) -> None:
        if response.token_ids:
            self._ready.append(response)
        if response.error_code:
            self._end(refusal(response.error_code, response.error, response.error_transient))
            return
        if not response.token_ids:
            self._ready.append(response)
        if response.finish_reason:
            self._ended = True
        self._wake()


class DecodeSession(SessionStream):
    """The router's stream to one decode worker (``stub``: its DecodeWorker stub, secret included)."""

    role = "decode"

    def _cancel(self, call: SessionCall) -> None:
        if self._open_requests.get(call.request_id) is call:
            del self._open_requests[call.request_id]
            self._abort(call.request_id)

    def generate(self, request: worker_pb2.GenerateRequest) -> SessionCall:
        """Start ``request`` on the worker; its tokens arrive on the returned call."""
        call = SessionCall(self, request.request_id)
        self._start(request.request_id, request, call)
        return call

    def _message(self, starts, aborts):
        return worker_pb2.DecodeSessionRequest(generate=starts, abort=aborts)

    def _answers(self, response):
        return response.outputs

    def _deliver(self, target: SessionCall, answer: worker_pb2.GenerateResponse) -> bool:
        target._put(answer)
        return target._ended

    def _fail(self, target: SessionCall, error: grpc.aio.AioRpcError) -> None:
        target._end(error)


class PrefillSession(SessionStream):
    """The router's stream to one prefill worker (``stub``: its PrefillWorker stub, secret included)."""

    role = "prefill"

    def submit(self, request: worker_pb2.SubmitRequest, timeout_s: float) -> asyncio.Future[worker_pb2.SubmitResponse]:
        """``PrefillWorker.Submit`` on the stream: a future of the answer, or of AioRpcError
        (DEADLINE_EXCEEDED after ``timeout_s``). No task per request: the router's dispatcher
        handles the answer in a callback; cancelling the future forgets the request."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[worker_pb2.SubmitResponse] = loop.create_future()
        if not self._start(request.request_id, request, answer):
            return answer
        request_id = request.request_id
        timer = loop.call_later(timeout_s, self._expire, request_id, answer, timeout_s)

        def done(_: asyncio.Future) -> None:
            timer.cancel()
            if self._open_requests.get(request_id) is answer:
                del self._open_requests[request_id]   # expired or cancelled: a late answer is dropped
        answer.add_done_callback(done)
        return answer

    def _expire(self, request_id: str, answer: asyncio.Future, timeout_s: float) -> None:
        if not answer.done():
            answer.set_exception(rpc_error(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer to Submit from prefill worker {self.address} in {timeout_s:g} s"))

    def abort(self, request_id: str) -> None:
        """``PrefillWorker.Abort`` on the stream, after anything sent before it (a Submit still
        unanswered gets its answer); nothing comes back."""
        self._abort(request_id)

    def _message(self, starts, aborts):
        return worker_pb2.PrefillSessionRequest(submit=starts, abort=aborts)

    def _answers(self, response):
        return response.results

    def _deliver(self, target: asyncio.Future, answer: worker_pb2.SubmitResponse) -> bool:
        if not target.done():
            if answer.error_code:
                target.set_exception(refusal(answer.error_code, answer.error))
            else:
                target.set_result(answer)
        return True

    def _fail(self, target: asyncio.Future, error: grpc.aio.AioRpcError) -> None:
        if not target.done():
            target.set_exception(error)
