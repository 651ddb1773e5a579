"""The public gRPC service tandem.v1.Tandem (router process): a thin servicer over Frontend.

A bad request ends with INVALID_ARGUMENT (or the RouterError's code) before any message is
sent; templating and tokenizing run off the event loop like on HTTP; anything unexpected is
logged and ends as INTERNAL, never a dropped stream.

Also the API-key interceptor: with a key set, every Tandem call needs metadata
``authorization: Bearer KEY`` (health and reflection stay open, as load balancers expect).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from router import errors
from router.cluster import cluster_view
from router.frontend import Frontend, PreparedRequest, TextChunk

logger = logging.getLogger(__name__)
SERVICE_NAME = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name
INLINE_CHARS = 4 << 10   # smaller requests are tokenized on the loop (cheaper than a thread hop)


def chunk_to_proto(request_id: str, chunk: TextChunk) -> tandem_pb2.CompletionChunk:
    msg = tandem_pb2.CompletionChunk(request_id=request_id, text=chunk.text, token_ids=chunk.token_ids)
    for lp in chunk.logprobs:
        msg.logprobs.append(tandem_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob,
            top=[tandem_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]))
    if chunk.finish_reason:
        msg.finish_reason = chunk.finish_reason
        u = chunk.usage
        msg.usage.CopyFrom(tandem_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                            cached_tokens=u.cached_tokens))
    return msg


class Undecodable:
    """Stands in for a request message protobuf could not parse (DecodeErrorInterceptor)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Hands a Tandem method an ``Undecodable`` for bytes protobuf cannot parse (a string field
    that is not UTF-8, a truncated message), so the servicer answers INVALID_ARGUMENT where
    grpc would say UNKNOWN. Only the deserializer is wrapped: nothing is added per message."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if (handler is None or handler.request_streaming or handler.request_deserializer is None
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
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def _stream(self, prepare: Callable[[], PreparedRequest], num_chars: int,
                      context: grpc.aio.ServicerContext):
        try:
            request = prepare() if num_chars <= INLINE_CHARS else await asyncio.to_thread(prepare)
            self.frontend.admit()
            async for chunk in self.frontend.stream(request):
                yield chunk_to_proto(request.request_id, chunk)
        except errors.RouterError as exc:
            await context.abort(exc.grpc_code, exc.message)
        except Exception:  # noqa: BLE001 - a clean status instead of a dropped stream
            logger.exception("unexpected error in %s", type(self).__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")

    async def Generate(self, request: tandem_pb2.CompletionRequest, context):
        await _refuse_undecodable(request, context)
        def prepare() -> PreparedRequest:
            self.frontend.check_model(request.model)
            return self.frontend.prepare_prompt(request.prompt, request.prompt_token_ids, request.sampling,
                                                request.request_id, default_max_tokens=16)
        async for msg in self._stream(prepare, len(request.prompt) + len(request.prompt_token_ids), context):
            yield msg

    async def Chat(self, request: tandem_pb2.ChatRequest, context):
        await _refuse_undecodable(request, context)
        def prepare() -> PreparedRequest:
            self.frontend.check_model(request.model)
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            return self.frontend.prepare_chat(messages, request.sampling, request.request_id)
        async for msg in self._stream(prepare, sum(len(m.content) for m in request.messages), context):
            yield msg

    async def ListModels(self, request, context):
        return tandem_pb2.ListModelsResponse(models=[tandem_pb2.ModelInfo(
            id=self.frontend.model_name, max_model_len=self.frontend.registry.max_model_len or 0, owned_by="tandem")])

    async def GetCluster(self, request, context):
        return tandem_pb2.GetClusterResponse(workers=[tandem_pb2.WorkerStatus(**w)
                                                      for w in cluster_view(self.frontend.registry)])


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

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        if not details.method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(details)
        given = next((v for k, v in (details.invocation_metadata or ()) if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._expected):
            return await continuation(details)
        return self._deny_stream if details.method.endswith(("/Generate", "/Chat")) else self._deny_unary
