"""The router's data plane to its workers: one long-lived ``Session`` stream per worker.

Every request the router sends to a worker travels on the one stream it keeps open to that
worker, instead of a call of its own: what is started or aborted in the same turn of the event
loop leaves in one message, and a decode worker's engine step brings the tokens of all of them
back in one message. Per request that saves the gRPC calls (HTTP/2 stream set-up, metadata, a
completion-queue round per message); per token, a message.

- ``DecodeSession.generate`` returns a ``SessionCall``, which the dispatcher uses as it would a
  unary-stream call: iterate it for ``GenerateResponse`` messages, ``cancel()`` it (the worker is
  told to abort the request), ``done()``.
- ``DecodeSession.set_prefill`` points a request still waiting for its KV at another prefill
  worker (``DecodeWorker.SetPrefill``: a unary call beside the stream, on the same stub).
- ``PrefillSession.submit`` returns a future of the ``SubmitResponse``; ``abort`` stops the
  request at the prefill worker, without an answer.

A request the worker refuses or fails ends with ``grpc.aio.AioRpcError`` carrying the worker's
status code. When a stream breaks (the worker died, the connection dropped, the registry removed
the worker) every request open on it ends with that error and the next request opens a new
stream; the worker frees what was open on a decode stream that broke. The batching, reading and
breaking are protos/streams.py's ``SessionStream``, which the SDK's Multiplex stream is made of too.

Runs on the router's asyncio loop; nothing here is thread-safe.
"""
from __future__ import annotations

import asyncio

import grpc

from protos.streams import PendingMessages, SessionStream, refusal, rpc_error
from protos.tandem.v1 import worker_pb2


class WorkerSession(SessionStream):
    """A session to one worker (``stub``: its worker service's stub, secret included)."""

    role = ""

    @property
    def peer(self) -> str:
        return f"{self.role} worker {self.address}"


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


class DecodeSession(WorkerSession):
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

    async def set_prefill(self, request_id: str, prefill_address: str, timeout_s: float) -> None:
        """Have the worker take ``request_id``'s KV from ``prefill_address`` instead, keeping its
        reservation; raises AioRpcError (NOT_FOUND: the request is past waiting for its KV)."""
        request = worker_pb2.SetPrefillRequest(request_id=request_id, prefill_address=prefill_address)
        await self._stub.SetPrefill(request, timeout=timeout_s)

    def _message(self, starts, aborts):
        return worker_pb2.DecodeSessionRequest(generate=starts, abort=aborts)

    def _answers(self, response):
        return response.outputs

    def _deliver(self, target: SessionCall, answer: worker_pb2.GenerateResponse) -> bool:
        target._put(answer)
        return target._ended

    def _fail(self, target: SessionCall, error: grpc.aio.AioRpcError) -> None:
        target._end(error)


class PrefillSession(WorkerSession):
    """The router's stream to one prefill worker (``stub``: its PrefillWorker stub, secret included)."""

    role = "prefill"

    def submit(self, request: worker_pb2.SubmitRequest, timeout_s: float) -> asyncio.Future[worker_pb2.SubmitResponse]:
        """Submit ``request`` on the stream: a future of the answer, or of AioRpcError
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
        """Stop ``request_id`` at the worker, after anything sent before it on the stream (a Submit still
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
