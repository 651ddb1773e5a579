"""The OpenAI-compatible HTTP API on FastAPI (router process, on the router's asyncio loop).

/v1/completions and /v1/chat/completions (plain JSON or SSE ending in ``data: [DONE]``),
/v1/models, /v1/cluster, /health, /metrics. Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``.

Every bad request is answered with a 4xx before any stream byte, in this order and as cheaply
as it can be: the Host header against ``allowed_hosts`` (DNS rebinding; /health stays open) and,
with an API key, ``Authorization: Bearer KEY`` on /v1/*, both before the body is read; the body
size against ``max_request_body_bytes`` (413) while it is read; then parsing (a large body with
very many values in a child process first: router/body_check.py), the counts (prompts, token ids
per prompt, messages) on the parsed JSON before pydantic builds a model per element, field
checks, the fan-out cap (prompts x n) and, off the event loop for any body larger than
INLINE_PREPARE_BYTES (content, message count and tool schemas all grow it), templating and
tokenizing. A large non-streaming answer (n x max_tokens x top logprobs) is
built and encoded off the loop too. A non-streaming request whose client disconnects is
cancelled, which aborts it at both workers, as closing a stream does; a client gone during its
upload is one log line. Connection-level limits (head size, header count, slow heads and
bodies) are router/http_server.py's.

With an API key, /metrics wants it too (unless ``metrics_without_api_key``), and /v1/cluster
shows per-role counts and health only; the addresses stay on the Admin service.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from protos.limits import ROLES
from router import errors
from router.body_check import ChildCheck, SizeLimits, check_sizes
from router.cluster import cluster_view
from router.config import RouterConfig
from router.frontend import Frontend, PreparedRequest, TextChunk
from router.openai_types import Body, ChatCompletionRequest, CompletionRequest, NamedToolChoice, parse_body
from router.tool_calls import ToolCall
from router.tool_choice import AnswerReader, ToolRequest

logger = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Bodies under these sizes are parsed / templated and tokenized on the loop: tens of microseconds,
# less than the hop to a thread. Anything larger goes to a thread so it never stalls the loop.
INLINE_BYTES = 16 << 10
INLINE_PREPARE_BYTES = 4 << 10
INLINE_RESPONSE_ITEMS = 4096     # characters + logprob entries of a non-streaming answer built on the loop
CLIENT_CLOSED_REQUEST = 499   # nginx's status for "the client went away first"; nobody reads it


class ClientGone(Exception):
    """The client closed its connection while its request body was being read."""


def _error_response(exc: errors.RouterError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return JSONResponse(exc.to_json(), status_code=exc.http_status, headers=headers)


def _sse(payload: dict, exact_json: bool = False) -> bytes:
    """One SSE event. orjson is ~10x faster than json.dumps here but writes NaN and +-inf as
    null; ``exact_json`` keeps json's spelling (-Infinity) for a payload carrying such a logprob."""
    if exact_json:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _encode(payload: dict, exact_json: bool = False) -> bytes:
    """A JSON body, with ``_sse``'s rule for non-finite logprobs."""
    if exact_json:
        return json.dumps(payload, separators=(",", ":")).encode()
    return orjson.dumps(payload)


def _num_items(chunks: list[TextChunk]) -> int:
    """About how many values a non-streaming answer holds: characters and logprob entries."""
    return sum(len(c.text) + len(c.logprobs) * (2 + (len(c.logprobs[0].top_token_ids) if c.logprobs else 0))
               for c in chunks)


def _has_non_finite(chunk: TextChunk) -> bool:
    return not all(math.isfinite(lp.logprob) and all(map(math.isfinite, lp.top_logprobs)) for lp in chunk.logprobs)


class LogprobFormatter:
    """Token strings for logprobs, cached per token id."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def completion(self, chunk: TextChunk, offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for lp in chunk.logprobs:
            tokens.append(self.token(lp.token_id))
            lps.append(lp.logprob)
            tops.append({self.token(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, chunk: TextChunk) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]}
                            for lp in chunk.logprobs]}


def _usage(chunks: list[TextChunk]) -> dict:
    prompt = sum(c.usage.prompt_tokens for c in chunks if c.usage)
    completion = sum(c.usage.completion_tokens for c in chunks if c.usage)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _merge(streams: list[AsyncIterator[TextChunk]]) -> AsyncIterator[tuple[int, TextChunk]]:
    """Chunks of several streams as they come, tagged with the stream's index (n > 1)."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[TextChunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer below
            await queue.put((index, None, exc))
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, chunk, exc = await queue.get()
            if exc is not None:
                raise exc
            if chunk is None:
                remaining -= 1
            else:
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _hostname(host: str) -> str:
    """``host[:port]`` -> host (IPv6 literals keep their brackets)."""
    if host.startswith("["):
        return host[:host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def _client_gone(request: Request) -> None:
    """Returns once the client disconnects (call after the body was read)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a connection that cannot be watched is never reported gone
        logger.debug("cannot watch %r for a disconnect", request.url.path, exc_info=True)
        await asyncio.get_running_loop().create_future()


class HttpApi:
    def __init__(self, frontend: Frontend, config: RouterConfig) -> None:
        self.frontend = frontend
        self.api_key = config.api_key
        self.allowed_hosts = frozenset(config.allowed_hosts)
        self.max_body_bytes = config.max_request_body_bytes
        self.metrics_need_key = bool(config.api_key) and not config.metrics_without_api_key
        self.logprobs = LogprobFormatter(frontend.tokenizer)

    def check_host(self, request: Request) -> None:
        if not self.allowed_hosts:
            return
        host = request.headers.get("host", "").lower()
        if host not in self.allowed_hosts and _hostname(host) not in self.allowed_hosts:
            raise errors.host_not_allowed(host)

    def check_key(self, request: Request) -> None:
        self.check_host(request)
        if not self.api_key:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise errors.unauthorized()

    async def read(self, request: Request, model: type[Body]) -> tuple[Body, int]:
        """The body as ``model`` and its size in bytes: 413 as soon as it is known to be too large
        (Content-Length, or the bytes read so far), before any parsing."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise errors.body_too_large(self.max_body_bytes)
        parts, nbytes = [], 0
        try:
            async for part in request.stream():
                nbytes += len(part)
                if nbytes > self.max_body_bytes:
                    raise errors.body_too_large(self.max_body_bytes)
                parts.append(part)
        except ClientDisconnect:
            logger.info("a client closed its connection during its upload to %s (%d bytes read)",
                        request.url.path, nbytes)
            raise ClientGone from None
        raw = b"".join(parts)
        limits = self._size_limits()
        check = functools.partial(check_sizes, limits=limits)
        if nbytes <= INLINE_BYTES:
            return parse_body(raw, model, check), nbytes
        if ChildCheck.wanted(raw):   # a parse that would hold the GIL long: refused in a child first
            await ChildCheck.refuse(raw, model is ChatCompletionRequest, limits)
        return await asyncio.to_thread(parse_body, raw, model, check), nbytes

    def _size_limits(self) -> SizeLimits:
        return SizeLimits(self.frontend.max_sub_requests, self.frontend.max_prompt_chars,
                          self.frontend.registry.max_model_len)

    @staticmethod
    async def _off_loop(body_nbytes: int, fn, *args):
        """``fn(*args)`` on the loop for a small body, else on a thread: templating and tokenizing
        grow with the body (its text, its number of messages, its tool schemas), never beyond it."""
        return fn(*args) if body_nbytes <= INLINE_PREPARE_BYTES else await asyncio.to_thread(fn, *args)

    @staticmethod
    async def _json(build, num_items: int) -> Response:
        """The JSON answer ``build()`` returns, built and encoded on a thread when it holds more
        than INLINE_RESPONSE_ITEMS characters and logprob entries (16 choices x thousands of
        tokens x 20 top logprobs is seconds of Python)."""
        if num_items <= INLINE_RESPONSE_ITEMS:
            return Response(_encode(*build()), media_type="application/json")
        return Response(await asyncio.to_thread(lambda: _encode(*build())), media_type="application/json")

    @staticmethod
    def _fan_out(first: PreparedRequest, n: int, seed: int | None, base: str, suffix: str) -> list[PreparedRequest]:
        """The n choices of one prompt, tokenized once: choice j has id ``<base>-j<suffix>`` and seed + j."""
        if n == 1:
            return [first]
        return [dataclasses.replace(first, request_id=f"{base}-{j}{suffix}", params=_with_seed(first.params, seed, j))
                for j in range(n)]

    async def _respond(self, request: Request, streams, stream_body) -> list[TextChunk] | Response:
        """A StreamingResponse, or every stream collected; a client gone first cancels them."""
        if stream_body is not None:
            return StreamingResponse(stream_body, media_type="text/event-stream", headers=SSE_HEADERS)
        collect = asyncio.ensure_future(asyncio.gather(*(_collect(s) for s in streams)))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (collect, gone):
                task.cancel()
            await asyncio.gather(collect, gone, return_exceptions=True)
        if collect.cancelled():
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return list(collect.result())

    # -- completions ------------------------------------------------------------------------

    def _prepare_completions(self, body: CompletionRequest, prompts, sampling) -> list[PreparedRequest]:
        base = body.request_id or self.frontend.new_request_id()
        requests: list[PreparedRequest] = []
        for p, (text, token_ids) in enumerate(prompts):
            suffix = f"-p{p}" if len(prompts) > 1 else ""
            rid = f"{base}-0{suffix}" if body.n > 1 else f"{base}{suffix}"
            first = self.frontend.prepare_prompt(text, token_ids, sampling, rid)
            requests += self._fan_out(first, body.n, body.seed, base, suffix)
        return requests

    async def completions(self, request: Request):
        body, nbytes = await self.read(request, CompletionRequest)
        if body.echo:
            raise errors.invalid_request("echo is not supported", "echo")
        self.frontend.check_model(body.model)
        prompts = body.prompts()
        self.frontend.check_fan_out(len(prompts), body.n)
        sampling = body.sampling(body.max_tokens, body.logprobs)
        requests = await self._off_loop(nbytes, self._prepare_completions, body, prompts, sampling)
        self.frontend.admit(requests)
        response_id = f"cmpl-{requests[0].request_id}"
        created = int(time.time())
        model = self.frontend.model_name
        streams = [self.frontend.stream(r) for r in requests]
        if body.stream and sampling.HasField("structured_outputs"):
            streams = await _primed(streams)
        stream_body = self._stream_completion(streams, response_id, created, model, body) if body.stream else None
        chunks = await self._respond(request, streams, stream_body)
        if not isinstance(chunks, list):
            return chunks

        def build() -> tuple[dict, bool]:
            choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                        "logprobs": self.logprobs.completion(c, 0) if body.logprobs is not None else None}
                       for i, c in enumerate(chunks)]
            return ({"id": response_id, "object": "text_completion", "created": created, "model": model,
                     "choices": choices, "usage": _usage(chunks)},
                    body.logprobs is not None and any(map(_has_non_finite, chunks)))
        return await self._json(build, _num_items(chunks))

    async def _stream_completion(self, streams, response_id: str, created: int, model: str,
                                 body: CompletionRequest) -> AsyncIterator[bytes]:
        finals: list[TextChunk] = []
        offsets = [0] * len(streams)
        try:
            async for index, chunk in _merge(streams):
                if chunk.finish_reason:
                    finals.append(chunk)
                logprobs = self.logprobs.completion(chunk, offsets[index]) if body.logprobs is not None else None
                offsets[index] += len(chunk.text)
                yield _sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": index, "text": chunk.text, "logprobs": logprobs,
                                         "finish_reason": chunk.finish_reason}]},
                           logprobs is not None and _has_non_finite(chunk))
            if body.include_usage:
                yield _sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(finals)})
        except errors.RouterError as exc:
            yield _sse(exc.to_json())
        yield b"data: [DONE]\n\n"

    # -- chat -------------------------------------------------------------------------------

    def _prepare_chat(self, body: ChatCompletionRequest, messages: list[dict], sampling,
                      tools: ToolRequest | None) -> list[PreparedRequest]:
        base = body.request_id or self.frontend.new_request_id()
        first = self.frontend.prepare_chat(messages, sampling, f"{base}-0" if body.n > 1 else base, tools=tools)
        return self._fan_out(first, body.n, body.seed, base, "")

    def _tool_request(self, body: ChatCompletionRequest) -> ToolRequest | None:
        choice = body.tool_choice
        return self.frontend.tool_request([t.as_dict() for t in body.tools or ()],
                                          choice.model_dump() if isinstance(choice, NamedToolChoice) else choice,
                                          body.parallel_tool_calls)

    async def chat(self, request: Request):
        body, nbytes = await self.read(request, ChatCompletionRequest)
        self.frontend.check_model(body.model)
        self.frontend.check_fan_out(1, body.n)
        sampling = body.sampling(body.max_output_tokens, body.num_logprobs)
        tools = self._tool_request(body)
        if tools is not None:
            tools.constrain(sampling)
        messages = [m.as_dict() for m in body.messages]
        requests = await self._off_loop(nbytes, self._prepare_chat, body, messages, sampling, tools)
        self.frontend.admit(requests)
        response_id = f"chatcmpl-{requests[0].request_id}"
        created = int(time.time())
        model = self.frontend.model_name
        streams = [self.frontend.stream(r) for r in requests]
        if body.stream and sampling.HasField("structured_outputs"):
            streams = await _primed(streams)
        stream_body = self._stream_chat(streams, response_id, created, model, body, tools) if body.stream else None
        chunks = await self._respond(request, streams, stream_body)
        if not isinstance(chunks, list):
            return chunks

        def build() -> tuple[dict, bool]:
            choices = []
            for i, c in enumerate(chunks):
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                finish = c.finish_reason
                if tools is not None:
                    parsed, finish = AnswerReader(tools).read(c.text, c.finish_reason)
                    message["content"] = (parsed.content or None) if parsed.tool_calls else parsed.content
                    if parsed.tool_calls:
                        message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
                choices.append({"index": i, "message": message, "finish_reason": finish,
                                "logprobs": self.logprobs.chat(c) if body.logprobs else None})
            return ({"id": response_id, "object": "chat.completion", "created": created, "model": model,
                     "choices": choices, "usage": _usage(chunks)},
                    body.logprobs and any(map(_has_non_finite, chunks)))
        return await self._json(build, _num_items(chunks))

    async def _stream_chat(self, streams, response_id: str, created: int, model: str,
                           body: ChatCompletionRequest, tools: ToolRequest | None) -> AsyncIterator[bytes]:
        head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}
        finals: list[TextChunk] = []
        readers = [AnswerReader(tools) for _ in streams] if tools is not None else None
        try:
            for index in range(len(streams)):
                yield _sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            async for index, chunk in _merge(streams):
                if chunk.finish_reason:
                    finals.append(chunk)
                text, calls, finish, first_call = chunk.text, [], chunk.finish_reason, 0
                if readers is not None:
                    first_call = readers[index].num_calls
                    parsed, finish = readers[index].read(chunk.text, chunk.finish_reason)
                    text, calls = parsed.content, parsed.tool_calls
                delta = {"content": text} if text or not finish else {}
                yield _sse({**head, "choices": [{"index": index, "delta": delta,
                                                 "logprobs": self.logprobs.chat(chunk) if body.logprobs else None,
                                                 "finish_reason": None if calls else finish}]},
                           body.logprobs and _has_non_finite(chunk))
                for event in _tool_call_events(calls, first_call, index, finish):
                    yield _sse({**head, "choices": [event]})
            if body.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(finals)})
        except errors.RouterError as exc:
            yield _sse(exc.to_json())
        yield b"data: [DONE]\n\n"


def _tool_call_events(calls: list[ToolCall], first_index: int, choice_index: int, finish: str | None) -> list[dict]:
    """Stream choices announcing ``calls`` as OpenAI does: the call's id and name with empty
    arguments, then the arguments; the last event carries the finish_reason."""
    events = []
    for i, call in enumerate(calls, first_index):
        events.append({"index": choice_index, "delta": {"tool_calls": [
            {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]},
            "logprobs": None, "finish_reason": None})
        events.append({"index": choice_index, "delta": {"tool_calls": [
            {"index": i, "function": {"arguments": call.arguments}}]}, "logprobs": None, "finish_reason": None})
    if events and finish is not None:
        events.append({"index": choice_index, "delta": {}, "logprobs": None, "finish_reason": finish})
    return events


def _role_counts(registry) -> dict[str, dict[str, int]]:
    counts = {role: {"workers": 0, "healthy": 0} for role in ROLES}
    for worker in registry.all():
        role = counts.setdefault(worker.role, {"workers": 0, "healthy": 0})
        role["workers"] += 1
        role["healthy"] += bool(worker.healthy)
    return counts


def _with_seed(sampling, seed: int | None, j: int):
    """The worker's sampling for choice j: seed + j (openai_types checked that it fits int64)."""
    if seed is None:
        return sampling
    copy = type(sampling)()
    copy.CopyFrom(sampling)
    copy.seed = seed + j
    return copy


async def _primed(streams: list[AsyncGenerator[TextChunk, None]]) -> list[AsyncGenerator[TextChunk, None]]:
    """The streams with their first chunk already awaited, so that a constraint the workers refuse
    to compile (INVALID_ARGUMENT before any token) is a 400 here rather than an error event after
    a 200 went out. Only structured requests wait: their grammar is checked by the workers."""
    firsts = [asyncio.ensure_future(stream.__anext__()) for stream in streams]
    try:
        await asyncio.wait(firsts, return_when=asyncio.FIRST_EXCEPTION)
        error = next((e for t in firsts if t.done() and (e := t.exception()) is not None), None)
        if error is not None:
            raise error
    except BaseException:
        for task in firsts:
            task.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        raise
    return [_after(task.result(), stream) for task, stream in zip(firsts, streams)]


async def _after(first: TextChunk, rest: AsyncGenerator[TextChunk, None]) -> AsyncGenerator[TextChunk, None]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()   # a client gone mid-stream aborts the request at once


async def _collect(stream: AsyncIterator[TextChunk]) -> TextChunk:
    parts = [chunk async for chunk in stream]
    last = parts[-1]
    return TextChunk("".join(p.text for p in parts), [t for p in parts for t in p.token_ids],
                     [lp for p in parts for lp in p.logprobs], last.finish_reason, last.usage)


def create_app(frontend: Frontend, config: RouterConfig) -> FastAPI:
    api = HttpApi(frontend, config)
    app = FastAPI(title="Tandem router", docs_url=None, redoc_url=None)

    @app.exception_handler(errors.RouterError)
    async def router_error(request: Request, exc: errors.RouterError):
        return _error_response(exc)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        return Response(status_code=CLIENT_CLOSED_REQUEST)   # nobody reads it: the client is gone

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
        return _error_response(errors.invalid_request(message or "invalid request body", param))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %r", request.url.path)
        return _error_response(errors.internal(f"internal error: {type(exc).__name__}"))

    guarded = [Depends(api.check_key)]      # Host and API key: before the body is read
    host_checked = [Depends(api.check_host)]

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request):
        return await api.completions(request)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request):
        return await api.chat(request)

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [{"id": frontend.model_name, "object": "model", "created": 0,
                                            "owned_by": "tandem", "max_model_len": frontend.registry.max_model_len}]}

    @app.get("/v1/cluster", dependencies=guarded)
    async def cluster():
        if config.api_key:   # tenants: how many workers of each role serve, not where
            return {"roles": _role_counts(frontend.registry)}
        return {"workers": cluster_view(frontend.registry)}

    @app.get("/health")
    async def health():
        ok = all(frontend.registry.healthy(role) for role in ROLES)
        return JSONResponse({"status": "ok" if ok else "degraded"}, status_code=200 if ok else 503)

    @app.get("/metrics", dependencies=guarded if api.metrics_need_key else host_checked)
    async def metrics():
        return Response(frontend.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
