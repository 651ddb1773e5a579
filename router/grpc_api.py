"""The public gRPC service tandem.v1.Tandem (router process): a thin servicer over Frontend.

A bad request ends with INVALID_ARGUMENT (or the RouterError's code) before any message is
sent; templating and tokenizing run off the event loop like on HTTP; anything unexpected is
logged and ends as INTERNAL, never a dropped stream.

``Multiplex`` carries many requests on one stream (``Multiplexed``, the async SDK's transport):
each runs as on Generate or Chat, on a task of its own, and the events of all of them that are
ready in the same turn of the loop leave in one message -- at concurrency 64, one message per
decode step instead of one per request. A small request is validated, admitted and dispatched
as its start is read (``Frontend.open``), so its start leaves for the workers before its task
first runs; one cancelled before that is abandoned at the workers. A request waits for its
previous event to be written before it takes the next tokens, so a slow client gets its tokens
coalesced per request (``SessionCall.take``, router/session.py) instead of chunks queued here. A
bad request fails its key alone, with the status Generate would end with; a key already open or
bytes that are no message end the stream with INVALID_ARGUMENT. However the stream ends (done,
the client cancelled it, the connection dropped), every request still open on it is aborted at
the workers.

Bounds, so no one stream holds the loop or grows without end: a message may start at most
``max(max_waiting, MULTIPLEX_STARTS_PER_MESSAGE)`` requests (more could never all wait for their
first token; more ends the stream with INVALID_ARGUMENT before any of them is read; the SDK
sends at most MULTIPLEX_STARTS_PER_MESSAGE a message), and at most ``4 x max_waiting`` requests
may be open on one stream (a start beyond it fails its key with RESOURCE_EXHAUSTED, like a 429).
A request is templated on the loop only when it is small in characters AND in messages, so
100k empty messages go to a thread like one long one.

``GetCluster`` names no worker addresses unless the call carries the cluster secret (the
controller's does): see router/cluster.py.

Also the API-key interceptor: with a key set, every Tandem call needs metadata
``authorization: Bearer KEY`` (health and reflection stay open, as load balancers expect).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from protos.auth import check as check_secret
from protos.limits import MULTIPLEX_READY, MULTIPLEX_STARTS_PER_MESSAGE
from protos.streams import Wakeup
from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from router import errors
from router.cluster import cluster_view
from router.dispatch import Dispatch
from router.frontend import Frontend, PreparedRequest, TextChunk
from router.grpc_tools import chat_messages, fill_tool_calls, read_tool_calls, tool_request
from router.tool_choice import AnswerReader

logger = logging.getLogger(__name__)
SERVICE_NAME = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name
INLINE_CHARS = 4 << 10   # smaller requests are tokenized on the loop (cheaper than a thread hop) ...
INLINE_MESSAGES = 64     # ... when they also hold at most this many chat messages
OPEN_PER_STREAM_PER_WAITING = 4   # a Multiplex stream holds at most this x max_waiting open requests
YIELD_EVERY_STARTS = 64  # Multiplex: the loop is given back between this many starts of one message


def chunk_to_proto(request_id: str, chunk: TextChunk) -> tandem_pb2.CompletionChunk:
    msg = tandem_pb2.CompletionChunk()
    fill_chunk(msg, request_id, chunk)
    return msg


def fill_chunk(msg: tandem_pb2.CompletionChunk, request_id: str, chunk: TextChunk) -> None:
    msg.request_id = request_id
    msg.text = chunk.text
    msg.token_ids.extend(chunk.token_ids)
    for lp in chunk.logprobs:
        msg.logprobs.append(tandem_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob,
            top=[tandem_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]))
    fill_tool_calls(msg, chunk)
    if chunk.finish_reason:
        msg.finish_reason = chunk.finish_reason
        u = chunk.usage
        assert u is not None   # the last chunk carries usage
        msg.usage.prompt_tokens = u.prompt_tokens
        msg.usage.completion_tokens = u.completion_tokens
        msg.usage.cached_tokens = u.cached_tokens


class Undecodable:
    """Stands in for a request message protobuf could not parse (DecodeErrorInterceptor)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Hands a Tandem method an ``Undecodable`` for bytes protobuf cannot parse (a string field
    that is not UTF-8, a truncated message), so the servicer answers INVALID_ARGUMENT where
    grpc would say UNKNOWN (Multiplex: in place of the bad message on the stream). Only the
    deserializer is wrapped: nothing is added per message."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if (handler is None or handler.request_deserializer is None
                or not details.method.startswith(f"/{SERVICE_NAME}/")):
            return handler
        parse = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return parse(data)
            except DecodeError as exc:
                return Undecodable(str(exc))
        return handler._replace(request_deserializer=lenient)


async def _refuse_undecodable(request, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message: {request.reason}")


class TandemServicer(tandem_pb2_grpc.TandemServicer):
    def __init__(self, frontend: Frontend, cluster_secret: str | None = None) -> None:
        """``cluster_secret``: a GetCluster call carrying it sees the workers' addresses."""
        self.frontend = frontend
        self._cluster_secret = cluster_secret
        self.max_starts_per_message = max(frontend.max_waiting, MULTIPLEX_STARTS_PER_MESSAGE)
        self.max_open_per_stream = OPEN_PER_STREAM_PER_WAITING * frontend.max_waiting

    def preparer(self, request: tandem_pb2.CompletionRequest | tandem_pb2.ChatRequest
                 ) -> tuple[Callable[[], PreparedRequest], bool]:
        """What validates, templates and tokenizes ``request`` (raising RouterError), and
        whether that is cheap enough to run on the loop."""
        frontend = self.frontend
        if isinstance(request, tandem_pb2.ChatRequest):
            def prepare() -> PreparedRequest:
                frontend.check_model(request.model)
                frontend.check_num_messages(len(request.messages))   # before a dict is built per message
                tools, sampling = tool_request(frontend, request), request.sampling
                if tools is not None and tools.forced:
                    sampling = tandem_pb2.Sampling()
                    sampling.CopyFrom(request.sampling)
                    tools.constrain(sampling)
                return frontend.prepare_chat(chat_messages(request), sampling, request.request_id, tools=tools)
            # Counted before summed: the sum itself walks every message.
            if len(request.messages) > INLINE_MESSAGES or len(request.tools) > INLINE_MESSAGES:
                return prepare, False
            if request.tools or any(m.tool_calls for m in request.messages):
                num_chars = request.ByteSize()   # in C: a message's calls are not counted before they are walked
            else:
                num_chars = sum(len(m.content) + len(m.role) for m in request.messages)
        else:
            def prepare() -> PreparedRequest:
                frontend.check_model(request.model)
                return frontend.prepare_prompt(request.prompt, request.prompt_token_ids, request.sampling,
                                               request.request_id)
            num_chars = len(request.prompt) + len(request.prompt_token_ids)
        return prepare, num_chars <= INLINE_CHARS

    async def prepare(self, request: tandem_pb2.CompletionRequest | tandem_pb2.ChatRequest) -> PreparedRequest:
        """Validate, template, tokenize (off the loop when large) and admit; raises RouterError."""
        prepare, inline = self.preparer(request)
        prepared = prepare() if inline else await asyncio.to_thread(prepare)
        self.frontend.admit([prepared])
        return prepared

    async def _stream(self, request, context: grpc.aio.ServicerContext):
        await _refuse_undecodable(request, context)
        try:
            prepared = await self.prepare(request)
            reader = AnswerReader(prepared.tools) if prepared.tools is not None else None
            async for chunk in self.frontend.stream(prepared):
                yield chunk_to_proto(prepared.request_id, read_tool_calls(reader, chunk))
        except errors.RouterError as exc:
            await context.abort(exc.grpc_code, exc.message)
        except Exception:  # noqa: BLE001 - a clean status instead of a dropped stream
            logger.exception("unexpected error in %s", type(self).__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")

    # Async generator functions themselves (grpc.aio tells a streaming handler by that).
    Generate = _stream
    Chat = _stream

    async def Multiplex(self, request_iterator, context):
        await context.send_initial_metadata((MULTIPLEX_READY,))   # the SDK writes after this
        mux = Multiplexed(self)
        try:
            async for response in mux.serve(request_iterator):
                yield response
        except errors.RouterError as exc:
            await context.abort(exc.grpc_code, exc.message)

    async def ListModels(self, request, context):
        return tandem_pb2.ListModelsResponse(models=[tandem_pb2.ModelInfo(
            id=self.frontend.model_name, max_model_len=self.frontend.registry.max_model_len or 0, owned_by="tandem")])

    async def GetCluster(self, request, context):
        internal = (self._cluster_secret is not None
                    and check_secret(context.invocation_metadata(), self._cluster_secret) is None)
        return tandem_pb2.GetClusterResponse(workers=[tandem_pb2.WorkerStatus(**w) for w in
                                                      cluster_view(self.frontend.registry, addresses=internal)])


class Multiplexed:
    """The requests of one Multiplex stream (see the module docstring); ``serve`` is the handler."""

    def __init__(self, servicer: TandemServicer) -> None:
        self._servicer = servicer
        self._open: dict[int, asyncio.Task] = {}
        # (key, request_id, chunk, status, error): a chunk, or a failure when chunk is None
        self._events: list[tuple[int, str, TextChunk | None, grpc.StatusCode | None, str]] = []
        self._written = asyncio.get_running_loop().create_future()   # resolved once the queued events are written
        self._wakeup = Wakeup()   # serve sleeps on it until there are events or the end
        self._reading = True
        self._error: errors.RouterError | None = None

    async def serve(self, requests: AsyncIterator) -> AsyncIterator[tandem_pb2.MultiplexResponse]:
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(requests))
        try:
            while True:
                if self._error is not None:
                    raise self._error
                if not self._events:
                    if not self._reading and not self._open:
                        return
                    await self._wakeup.wait()
                    continue
                events, written = self._events, self._written
                self._events, self._written = [], loop.create_future()
                response = tandem_pb2.MultiplexResponse()
                for key, request_id, chunk, code, error in events:
                    event = response.events.add()
                    event.key = key
                    if chunk is not None:
                        fill_chunk(event.chunk, request_id, chunk)
                    else:
                        assert code is not None
                        event.error_code, event.error = code.value[0], error
                yield response
                written.set_result(None)
        finally:
            tasks = [reader, *self._open.values()]
            self._open.clear()
            for task in tasks:
                task.cancel()     # a request still open is aborted at its workers
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator) -> None:
        try:
            async for message in requests:
                if isinstance(message, Undecodable):
                    raise errors.invalid_request(f"a Multiplex message is not a valid message: {message.reason}")
                num_starts = len(message.start)
                if num_starts > self._servicer.max_starts_per_message:
                    raise errors.invalid_request(
                        f"a Multiplex message starts {num_starts} requests, more than the "
                        f"{self._servicer.max_starts_per_message} one message may (max_waiting); send fewer per "
                        "message", "start")
                for i, start in enumerate(message.start):
                    if i and i % YIELD_EVERY_STARTS == 0:
                        await asyncio.sleep(0)   # the others' tokens go out between the starts of a big message
                    self._start(start)
                for key in message.cancel:
                    task = self._open.pop(key, None)
                    if task is not None:
                        task.cancel()
                if message.start:
                    await asyncio.sleep(0)   # the starts go to the workers before the next read is set up
        except errors.RouterError as exc:
            self._error = exc
        finally:
            self._reading = False
            self._wakeup.wake()

    def _start(self, start: tandem_pb2.MultiplexStart) -> None:
        key = start.key
        if key in self._open:
            raise errors.invalid_request(f"key {key} is already open on this Multiplex stream", "key")
        if len(self._open) >= self._servicer.max_open_per_stream:
            self._fail(key, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"{len(self._open)} requests are open on this Multiplex stream, the most one stream may "
                       f"hold ({OPEN_PER_STREAM_PER_WAITING} x max_waiting); wait for some to finish or open "
                       "another stream")
            return
        which = start.WhichOneof("request")
        if which is None:
            self._fail(key, grpc.StatusCode.INVALID_ARGUMENT, "a start needs a completion or a chat request")
            return
        request = getattr(start, which)
        prepare, inline = self._servicer.preparer(request)
        opened: tuple[PreparedRequest, Dispatch] | None = None
        if inline:
            # A small request is started here and now: its start leaves for the workers in the
            # next turn of the loop, ahead of its task.
            frontend = self._servicer.frontend
            try:
                prepared = prepare()
                frontend.admit([prepared])
                opened = prepared, frontend.open(prepared)
            except errors.RouterError as exc:
                self._fail(key, exc.grpc_code, exc.message)
                return
            except Exception:  # noqa: BLE001 - a clean status for this key instead of a dropped stream
                logger.exception("unexpected error starting a Multiplex request")
                self._fail(key, grpc.StatusCode.INTERNAL, "internal error")
                return
        task = asyncio.get_running_loop().create_task(self._run(key, request, opened))
        self._open[key] = task
        task.add_done_callback(lambda task: self._task_done(key, task, opened))

    async def _run(self, key: int, request: tandem_pb2.CompletionRequest | tandem_pb2.ChatRequest,
                   opened: tuple[PreparedRequest, Dispatch] | None) -> None:
        try:
            if opened is None:
                prepared, dispatch = await self._servicer.prepare(request), None
            else:
                prepared, dispatch = opened
            reader = AnswerReader(prepared.tools) if prepared.tools is not None else None
            # aclosing: a cancel while this waits for a write still aborts the request at once.
            async with contextlib.aclosing(self._servicer.frontend.stream(prepared, dispatch)) as chunks:
                async for chunk in chunks:
                    chunk = read_tool_calls(reader, chunk)
                    self._events.append((key, prepared.request_id, chunk, None, ""))
                    self._wakeup.wake()
                    if chunk.finish_reason:
                        self._forget(key)   # the key is free as soon as its last event is queued
                        return
                    # The next tokens wait until this chunk is out: a slow client gets them coalesced.
                    await asyncio.shield(self._written)
        except errors.RouterError as exc:
            self._fail(key, exc.grpc_code, exc.message)
        except Exception:  # noqa: BLE001 - a clean status for this key instead of a dropped stream
            logger.exception("unexpected error in a Multiplex request")
            self._fail(key, grpc.StatusCode.INTERNAL, "internal error")

    def _fail(self, key: int, code: grpc.StatusCode, error: str) -> None:
        self._events.append((key, "", None, code, error))
        self._forget(key)
        self._wakeup.wake()

    def _forget(self, key: int) -> None:
        if self._open.get(key) is asyncio.current_task():
            del self._open[key]

    def _task_done(self, key: int, task: asyncio.Task, opened: tuple[PreparedRequest, Dispatch] | None) -> None:
        if opened is not None:
            self._servicer.frontend.abandon(opened[1])   # cancelled before it ran: aborted at the workers
        if self._open.get(key) is task:
            # Ended without a last event and not by the client's cancel: a cancellation from
            # inside (a worker call cancelled under it). The client still hears of it.
            del self._open[key]
            self._events.append((key, "", None, grpc.StatusCode.CANCELLED, "the request was cancelled"))
        self._wakeup.wake()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses Tandem calls without ``authorization: Bearer KEY`` metadata."""

    def __init__(self, api_key: str) -> None:
        self._expected = f"Bearer {api_key}".encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, errors.unauthorized().message)

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, errors.unauthorized().message)
            yield  # pragma: no cover - makes this an async generator

        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

        async def deny_multiplex(requests, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, errors.unauthorized().message)
            yield  # pragma: no cover - makes this an async generator

        self._deny_multiplex = grpc.stream_stream_rpc_method_handler(deny_multiplex)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        if not details.method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(details)
        given = next((v for k, v in (details.invocation_metadata or ()) if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._expected):
            return await continuation(details)
        if details.method.endswith("/Multiplex"):
            return self._deny_multiplex
        return self._deny_stream if details.method.endswith(("/Generate", "/Chat")) else self._deny_unary
