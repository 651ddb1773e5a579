"""The OpenAI-compatible HTTP API on FastAPI (router process, on the router's asyncio loop).

/v1/completions and /v1/chat/completions (plain JSON or SSE ending in ``data: [DONE]``),
/v1/models, /v1/cluster, /health, /metrics. Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``. With an API key, /v1/* needs
``Authorization: Bearer KEY``.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from collections.abc import AsyncIterator

import orjson

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router import errors
from router.cluster import cluster_view
from router.frontend import Frontend, PreparedRequest, TextChunk
from router.openai_types import ChatCompletionRequest, CompletionRequest, _SamplingFields

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _error_response(exc: errors.RouterError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return JSONResponse(exc.to_json(), status_code=exc.http_status, headers=headers)


def _sse(payload: dict, exact_json: bool = False) -> bytes:
    """One SSE event. orjson is ~10x faster than json.dumps here but writes NaN and +-inf as
    null; ``exact_json`` keeps json's spelling (-Infinity) for a payload carrying such a logprob."""
    if exact_json:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
    return b"data: " + orjson.dumps(payload) + b"\n\n"


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


class HttpApi:
    def __init__(self, frontend: Frontend, api_key: str = "") -> None:
        self.frontend = frontend
        self.api_key = api_key
        self.logprobs = LogprobFormatter(frontend.tokenizer)

    def check_key(self, request: Request) -> None:
        if not self.api_key:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise errors.unauthorized()

    def _prepare_all(self, body: _SamplingFields, prepare) -> list[PreparedRequest]:
        self.frontend.check_model(body.model)
        base = body.request_id or f"{uuid.uuid4().hex}"
        prepared = []
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j
            prepared.append(prepare(f"{base}-{j}" if body.n > 1 else base, seed))
        self.frontend.admit()
        return prepared

    # -- completions ------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest):
        if body.echo:
            raise errors.invalid_request("echo is not supported", "echo")
        sampling = body.sampling(body.max_tokens, body.logprobs)
        requests: list[PreparedRequest] = []
        prompts = body.prompts()
        for p, (text, token_ids) in enumerate(prompts):
            def prepare(request_id: str, seed: int | None, text=text, token_ids=token_ids, p=p):
                s = _with_seed(sampling, seed)
                rid = request_id if len(prompts) == 1 else f"{request_id}-p{p}"
                return self.frontend.prepare_prompt(text, token_ids, s, rid, default_max_tokens=16)
            requests += self._prepare_all(body, prepare)
        response_id = f"cmpl-{requests[0].request_id}"
        created = int(time.time())
        model = self.frontend.model_name
        streams = [self.frontend.stream(r) for r in requests]
        if body.stream:
            return StreamingResponse(self._stream_completion(streams, response_id, created, model, body),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        chunks = list(await asyncio.gather(*(_collect(s) for s in streams)))
        choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                    "logprobs": self.logprobs.completion(c, 0) if body.logprobs is not None else None}
                   for i, c in enumerate(chunks)]
        return {"id": response_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(chunks)}

    async def _stream_completion(self, streams, response_id: str, created: int, model: str,
                                 body: CompletionRequest) -> AsyncIterator[str]:
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

    async def chat(self, body: ChatCompletionRequest):
        sampling = body.sampling(body.max_output_tokens, body.num_logprobs)
        messages = [m.as_dict() for m in body.messages]

        def prepare(request_id: str, seed: int | None):
            return self.frontend.prepare_chat(messages, _with_seed(sampling, seed), request_id)
        requests = self._prepare_all(body, prepare)
        response_id = f"chatcmpl-{requests[0].request_id}"
        created = int(time.time())
        model = self.frontend.model_name
        streams = [self.frontend.stream(r) for r in requests]
        if body.stream:
            return StreamingResponse(self._stream_chat(streams, response_id, created, model, body),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        chunks = list(await asyncio.gather(*(_collect(s) for s in streams)))
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.logprobs.chat(c) if body.logprobs else None,
                    "finish_reason": c.finish_reason} for i, c in enumerate(chunks)]
        return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(chunks)}

    async def _stream_chat(self, streams, response_id: str, created: int, model: str,
                           body: ChatCompletionRequest) -> AsyncIterator[str]:
        head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}
        finals: list[TextChunk] = []
        try:
            for index in range(len(streams)):
                yield _sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            async for index, chunk in _merge(streams):
                if chunk.finish_reason:
                    finals.append(chunk)
                delta = {"content": chunk.text} if chunk.text or not chunk.finish_reason else {}
                yield _sse({**head, "choices": [{"index": index, "delta": delta,
                                                 "logprobs": self.logprobs.chat(chunk) if body.logprobs else None,
                                                 "finish_reason": chunk.finish_reason}]},
                           body.logprobs and _has_non_finite(chunk))
            if body.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(finals)})
        except errors.RouterError as exc:
            yield _sse(exc.to_json())
        yield b"data: [DONE]\n\n"


def _with_seed(sampling, seed: int | None):
    if seed is None:
        return sampling
    copy = type(sampling)()
    copy.CopyFrom(sampling)
    copy.seed = seed
    return copy


async def _collect(stream: AsyncIterator[TextChunk]) -> TextChunk:
    parts = [chunk async for chunk in stream]
    last = parts[-1]
    return TextChunk("".join(p.text for p in parts), [t for p in parts for t in p.token_ids],
                     [lp for p in parts for lp in p.logprobs], last.finish_reason, last.usage)


def create_app(frontend: Frontend, api_key: str = "") -> FastAPI:
    api = HttpApi(frontend, api_key)
    app = FastAPI(title="Tandem router", docs_url=None, redoc_url=None)

    @app.exception_handler(errors.RouterError)
    async def router_error(request: Request, exc: errors.RouterError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
        return _error_response(errors.invalid_request(message or "invalid request body", param))

    guarded = [Depends(api.check_key)]

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest):
        return await api.completions(body)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest):
        return await api.chat(body)

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [{"id": frontend.model_name, "object": "model", "created": 0,
                                            "owned_by": "tandem", "max_model_len": frontend.registry.max_model_len}]}

    @app.get("/v1/cluster", dependencies=guarded)
    async def cluster():
        return {"workers": cluster_view(frontend.registry)}

    @app.get("/health")
    async def health():
        ok = all(frontend.registry.healthy(role) for role in ("prefill", "decode"))
        return JSONResponse({"status": "ok" if ok else "degraded"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(frontend.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
