"""How `tandem bench` sends one request and times its stream (runs in the bench process's loop).

Every backend turns a ``BenchRequest`` into a ``RequestRecord`` with the same rules, the ones
of vLLM's request functions: the clock starts just before the request is sent; the first chunk
carrying content sets TTFT and each later one adds one ITL gap; every stream event (the usage
record included) moves the end time; output tokens come from the usage record when the server
sends one, else from the chunks. Errors never raise: they land in ``record.error``.
``record.start_s`` is left as a ``time.perf_counter()`` reading; the runner rebases it.

- ``openai-chat``: POST {base}/v1/chat/completions, SSE, ``delta.content``.
- ``openai``: POST {base}/v1/completions, SSE, ``text``.
- ``grpc``: Tandem's ``tandem_client.AsyncTandemClient`` (imported on first use, so the other
  backends work without the generated stubs).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from deploy.bench.config import EndpointConfig
from deploy.bench.datasets import BenchRequest
from deploy.bench.record import RequestRecord

_ERROR_BODY_CHARS = 300


@dataclass
class _Timer:
    """Turns chunk arrivals into TTFT, ITL and E2E (seconds from ``start``)."""
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last_content: float = 0.0
    last_event: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0

    def event(self, has_content: bool) -> None:
        now = time.perf_counter()
        self.last_event = now
        if not has_content:
            return
        if self.first is None:
            self.first = now
        else:
            self.itl_s.append(now - self.last_content)
        self.last_content = now
        self.num_chunks += 1

    def finish(self, record: RequestRecord, usage_tokens: int | None) -> None:
        if self.first is None:
            record.error = "the stream ended without any content"
            return
        record.ttft_s = self.first - self.start
        record.itl_s = self.itl_s
        record.e2e_s = self.last_event - self.start
        record.output_len = usage_tokens if usage_tokens is not None else self.num_chunks
        record.success = True


class OpenAIBackend:
    """An OpenAI-compatible HTTP server (vLLM, SGLang, Tandem's router, ...), streamed over SSE."""

    def __init__(self, endpoint: EndpointConfig, max_connections: int) -> None:
        import httpx

        self._endpoint = endpoint
        self._chat = endpoint.backend == "openai-chat"
        path = "/v1/chat/completions" if self._chat else "/v1/completions"
        self._url = endpoint.base_url.rstrip("/") + path
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        # One connection per request in flight: a pool queue would hide waiting inside TTFT.
        self._client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(endpoint.timeout_s),
                                         limits=httpx.Limits(max_connections=max_connections,
                                                             max_keepalive_connections=max_connections))
        self._errors = (httpx.HTTPError, OSError)

    def _payload(self, request: BenchRequest) -> dict:
        payload = {"model": self._endpoint.model, "max_tokens": request.max_tokens,
                   "temperature": self._endpoint.temperature, "stream": True,
                   "stream_options": {"include_usage": True}}
        if self._endpoint.ignore_eos:
            payload["ignore_eos"] = True
        if self._chat:
            payload["messages"] = request.chat_messages()
        else:
            payload["prompt"] = request.prompt
        return payload

    def _content(self, choice: dict) -> str:
        if self._chat:
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        payload = self._payload(request)
        timer = _Timer()
        record.start_s = timer.start
        usage_tokens = None
        try:
            async with self._client.stream("POST", self._url, json=payload) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace")[:_ERROR_BODY_CHARS]
                    record.error = f"HTTP {response.status_code}: {body}"
                    return
                async for line in response.aiter_lines():
                    # SSE: "data: <json>" events, blank separators, ":" comments (pings).
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        record.error = f"error in stream: {json.dumps(event['error'])[:_ERROR_BODY_CHARS]}"
                        return
                    choices = event.get("choices") or []
                    timer.event(any(self._content(c) for c in choices))
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens", usage_tokens)
        except self._errors as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            return
        except (json.JSONDecodeError, AttributeError) as exc:
            record.error = f"malformed stream event: {exc}"
            return
        timer.finish(record, usage_tokens)

    async def close(self) -> None:
        await self._client.aclose()


class GrpcBackend:
    """Tandem's gRPC API through ``tandem_client.AsyncTandemClient``."""

    def __init__(self, endpoint: EndpointConfig) -> None:
        from tandem_client import AsyncTandemClient, TandemError

        self._endpoint = endpoint
        self._client = AsyncTandemClient(endpoint.grpc_target, api_key=endpoint.api_key or None,
                                         model=endpoint.model, timeout_s=endpoint.timeout_s)
        self._errors = (TandemError,)

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        sampling: dict[str, Any] = {"max_tokens": request.max_tokens, "temperature": self._endpoint.temperature}
        if self._endpoint.ignore_eos:
            sampling["ignore_eos"] = True
        timer = _Timer()
        record.start_s = timer.start
        usage_tokens = None
        num_token_ids = 0
        try:
            stream = (self._client.chat_stream(request.chat_messages(), record.request_id, **sampling)
                      if request.messages is not None
                      else self._client.generate_stream(request.prompt, record.request_id, **sampling))
            async for chunk in stream:
                timer.event(bool(chunk.text or chunk.token_ids))
                num_token_ids += len(chunk.token_ids)
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
        except self._errors as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            return
        # gRPC chunks name their token ids, an exact count when usage is missing.
        timer.finish(record, usage_tokens if usage_tokens is not None else (num_token_ids or None))

    async def close(self) -> None:
        await self._client.close()


def make_backend(endpoint: EndpointConfig, max_connections: int):
    if endpoint.backend == "grpc":
        try:
            return GrpcBackend(endpoint)
        except ImportError as exc:
            raise ValueError(f"--backend grpc needs Tandem's gRPC client (tandem_client): {exc}") from exc
    return OpenAIBackend(endpoint, max_connections)
