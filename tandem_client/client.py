"""The SDK's clients: blocking ``TandemClient`` and asyncio ``AsyncTandemClient`` (the user's process).

    from tandem_client import TandemClient
    with TandemClient("127.0.0.1:50051", api_key=None) as client:
        out = client.generate("The capital of France is", max_tokens=16, temperature=0.0)
        print(out.text, out.finish_reason, out.usage)
        for chunk in client.chat_stream([{"role": "user", "content": "Hi"}], max_tokens=32):
            print(chunk.text, end="", flush=True)

``AsyncTandemClient`` has the same methods as coroutines / async iterators; it sends all its
requests on one ``Tandem.Multiplex`` stream (started and cancelled requests, and the chunks of
all of them, batched per message), or one call each with ``multiplex=False``. Sampling keywords:
temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty,
seed, max_tokens, ignore_eos, logprobs, stop (str or list), stop_token_ids. Failures raise a
``TandemError`` subclass carrying the gRPC status code.

Tools, in the OpenAI shape (the router's parser reads the calls out of the output)::

    out = client.chat(messages, tools=[{"type": "function", "function": {"name": "get_weather",
                                        "parameters": {"type": "object", "properties": {...}}}}])
    if out.finish_reason == "tool_calls":
        messages += [{"role": "assistant", "content": out.text, "tool_calls": out.tool_calls_openai()},
                     {"role": "tool", "tool_call_id": out.tool_calls[0].id, "content": "18 C"}]

``tool_choice`` is "auto" (the default with tools), "none", "required", or OpenAI's
``{"type": "function", "function": {"name": ...}}``; ``parallel_tool_calls`` as in OpenAI.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos.limits import MAX_MESSAGE_BYTES, MULTIPLEX_READY, MULTIPLEX_STARTS_PER_MESSAGE
from protos.streams import PendingMessages, SessionStream, refusal
from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc

_SAMPLING_FIELDS = {f.name for f in tandem_pb2.Sampling.DESCRIPTOR.fields}
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class TandemError(Exception):
    """A failed call; ``code`` is the grpc.StatusCode, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(TandemError): pass        # noqa: E701
class Unauthenticated(TandemError): pass        # noqa: E701
class ModelNotFound(TandemError): pass          # noqa: E701
class Overloaded(TandemError): pass             # noqa: E701
class Unavailable(TandemError): pass            # noqa: E701


_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument, grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
           grpc.StatusCode.NOT_FOUND: ModelNotFound, grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
           grpc.StatusCode.UNAVAILABLE: Unavailable}


def _error(exc: grpc.RpcError) -> TandemError:
    return _ERRORS.get(exc.code(), TandemError)(exc.code(), exc.details() or "")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str                                      # a JSON object, as text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Chunk:
    text: str                                           # with tools: content only
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[Any] = field(default_factory=list)   # tandem_pb2.TokenLogprob
    tool_calls: list[ToolCall] = field(default_factory=list)   # the calls completed in this chunk


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[Any] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)

    def tool_calls_openai(self) -> list[dict]:
        """The calls as an assistant message's ``tool_calls`` (for the next turn)."""
        return [c.to_openai() for c in self.tool_calls]


def _sampling(options: dict[str, Any]) -> tandem_pb2.Sampling:
    unknown = set(options) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling options {sorted(unknown)}; known: {sorted(_SAMPLING_FIELDS)}")
    if isinstance(options.get("stop"), str):
        options = {**options, "stop": [options["stop"]]}
    return tandem_pb2.Sampling(**{k: v for k, v in options.items() if v is not None})


def _completion_request(prompt: str | Sequence[int], model: str, request_id: str,
                        options: dict[str, Any]) -> tandem_pb2.CompletionRequest:
    request = tandem_pb2.CompletionRequest(model=model, sampling=_sampling(options), request_id=request_id)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    return request


def _message(m: dict) -> tandem_pb2.ChatMessage:
    calls = [tandem_pb2.ToolCall(id=c.get("id", ""), name=c["function"]["name"],
                                 arguments=c["function"].get("arguments") or "{}") for c in m.get("tool_calls") or ()]
    return tandem_pb2.ChatMessage(role=m["role"], content=m.get("content") or "", tool_calls=calls,
                                  tool_call_id=m.get("tool_call_id") or "")


def _tool(tool: dict) -> tandem_pb2.Tool:
    function = tool.get("function", tool)
    parameters = function.get("parameters")
    return tandem_pb2.Tool(name=function["name"], description=function.get("description") or "",
                           parameters=json.dumps(parameters) if parameters is not None else "")


def _chat_request(messages: Sequence[dict], model: str, request_id: str, options: dict[str, Any],
                  tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
                  parallel_tool_calls: bool | None = None) -> tandem_pb2.ChatRequest:
    request = tandem_pb2.ChatRequest(model=model, sampling=_sampling(options), request_id=request_id,
                                     messages=[_message(m) for m in messages], tools=[_tool(t) for t in tools or ()],
                                     parallel_tool_calls=parallel_tool_calls)
    if isinstance(tool_choice, dict):
        request.tool_choice_function = tool_choice["function"]["name"]
    elif tool_choice:
        request.tool_choice = tool_choice
    return request


def _chunk(msg: tandem_pb2.CompletionChunk) -> Chunk:
    usage = None
    if msg.finish_reason:
        usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens)
    return Chunk(msg.text, list(msg.token_ids), msg.finish_reason or None, usage, list(msg.logprobs),
                 [ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls])


def _join(chunks: list[Chunk]) -> Completion:
    last = chunks[-1]
    return Completion("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                      last.finish_reason or "", last.usage or Usage(0, 0), [lp for c in chunks for lp in c.logprobs],
                      [call for c in chunks for call in c.tool_calls])


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class TandemClient:
    """Blocking client. ``target`` is the router's gRPC ``host:port``."""

    def __init__(self, target: str = "127.0.0.1:50051", api_key: str | None = None, model: str = "",
                 timeout_s: float | None = None) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = tandem_pb2_grpc.TandemStub(self._channel)
        self._metadata = _metadata(api_key)
        self.model = model
        self.timeout_s = timeout_s

    def _stream(self, method, request) -> Iterator[Chunk]:
        call = method(request, metadata=self._metadata, timeout=self.timeout_s)
        try:
            for msg in call:
                yield _chunk(msg)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()  # no-op when finished; aborts the request if the caller stopped early

    def generate_stream(self, prompt: str | Sequence[int], request_id: str = "", **sampling) -> Iterator[Chunk]:
        return self._stream(self._stub.Generate, _completion_request(prompt, self.model, request_id, sampling))

    def generate(self, prompt: str | Sequence[int], request_id: str = "", **sampling) -> Completion:
        return _join(list(self.generate_stream(prompt, request_id, **sampling)))

    def chat_stream(self, messages: Sequence[dict], request_id: str = "", *, tools: Sequence[dict] | None = None,
                    tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
                    **sampling) -> Iterator[Chunk]:
        return self._stream(self._stub.Chat, _chat_request(messages, self.model, request_id, sampling, tools,
                                                           tool_choice, parallel_tool_calls))

    def chat(self, messages: Sequence[dict], request_id: str = "", **options) -> Completion:
        """``options``: sampling keywords and ``tools``, ``tool_choice``, ``parallel_tool_calls``."""
        return _join(list(self.chat_stream(messages, request_id, **options)))

    def _unary(self, method, request):
        try:
            return method(request, metadata=self._metadata, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def models(self) -> list[tandem_pb2.ModelInfo]:
        return list(self._unary(self._stub.ListModels, tandem_pb2.ListModelsRequest()).models)

    def cluster(self) -> list[tandem_pb2.WorkerStatus]:
        return list(self._unary(self._stub.GetCluster, tandem_pb2.GetClusterRequest()).workers)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _MultiplexCall(PendingMessages):
    """One request's chunks on the client's Multiplex stream (``take()`` hands them over)."""

    __slots__ = ("key", "_stream")

    def __init__(self, stream: _Multiplex, key: int) -> None:
        super().__init__()
        self.key = key
        self._stream = stream

    def put(self, event: tandem_pb2.MultiplexEvent) -> bool:
        """Deliver ``event``; True when it is the request's last (its finish or its error)."""
        if event.error_code:
            self._end(refusal(event.error_code, event.error))
        else:
            self._ready.append(event.chunk)
            self._ended = bool(event.chunk.finish_reason)
            self._wake()
        return self._ended

    def cancel(self) -> None:
        """Abort the request at the router unless it already ended."""
        self._stream.cancel(self)


class _Multiplex(SessionStream):
    """The client's one ``Tandem.Multiplex`` stream: what is started or cancelled in a turn of
    the loop leaves in one message; a broken stream fails every request open on it and the next
    request opens a new one (protos/streams.py does the batching and the breaking)."""

    keyed = True
    closed_reason = "is not used any more: the client was closed"

    def __init__(self, stub: tandem_pb2_grpc.TandemStub, target: str, metadata) -> None:
        super().__init__(stub, target)
        self._metadata = metadata
        self._next_key = 0

    @property
    def peer(self) -> str:
        return f"the router at {self.address}"

    def start(self, request: tandem_pb2.CompletionRequest | tandem_pb2.ChatRequest) -> _MultiplexCall:
        key, self._next_key = self._next_key, self._next_key + 1
        call = _MultiplexCall(self, key)
        if isinstance(request, tandem_pb2.ChatRequest):
            start = tandem_pb2.MultiplexStart(key=key, chat=request)
        else:
            start = tandem_pb2.MultiplexStart(key=key, completion=request)
        self._start(key, start, call)
        return call

    def cancel(self, call: _MultiplexCall) -> None:
        """Abort ``call`` at the router unless it already ended."""
        if self._open_requests.get(call.key) is call:
            del self._open_requests[call.key]
            self._abort(call.key)

    def _new_call(self):
        return self._stub.Multiplex(metadata=self._metadata)

    async def _ready(self, call) -> bool:
        """The router's MULTIPLEX_READY first; a server that refuses the stream sends its status
        alone, and writing nothing lets that status through as sent (not INTERNAL, grpc/grpc#36066)."""
        return MULTIPLEX_READY in tuple(await call.initial_metadata() or ())

    def _message(self, starts, aborts):
        return tandem_pb2.MultiplexRequest(start=starts, cancel=aborts)

    def _messages(self, starts, aborts):
        """As on any session, with at most MULTIPLEX_STARTS_PER_MESSAGE starts a message (what
        every router takes in one); the aborts still go last."""
        n = MULTIPLEX_STARTS_PER_MESSAGE
        if len(starts) <= n:
            return super()._messages(starts, aborts)
        messages = []
        for i in range(0, len(starts), n):
            last = i + n >= len(starts)
            messages += super()._messages(starts[i:i + n], aborts if last else [])
        return messages

    def _answers(self, response):
        return response.events

    def _deliver(self, target: _MultiplexCall, answer: tandem_pb2.MultiplexEvent) -> bool:
        return target.put(answer)

    def _fail(self, target: _MultiplexCall, error: grpc.aio.AioRpcError) -> None:
        target._end(error)


class AsyncTandemClient:
    """asyncio client with the same methods (``await client.generate(...)``, ``async for``).
    ``multiplex`` (default): every request on one stream to the router; False: a gRPC call each."""

    def __init__(self, target: str = "127.0.0.1:50051", api_key: str | None = None, model: str = "",
                 timeout_s: float | None = None, multiplex: bool = True) -> None:
        self._channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self._stub = tandem_pb2_grpc.TandemStub(self._channel)
        self._metadata = _metadata(api_key)
        self._multiplex = _Multiplex(self._stub, target, self._metadata) if multiplex else None
        self.model = model
        self.timeout_s = timeout_s

    async def _multiplexed(self, request) -> AsyncIterator[Chunk]:
        assert self._multiplex is not None
        call = self._multiplex.start(request)
        deadline = None if self.timeout_s is None else asyncio.get_running_loop().time() + self.timeout_s
        try:
            while True:
                try:
                    chunks = await call.take(deadline)
                except asyncio.TimeoutError:
                    raise TandemError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                        raise _error(exc) from None
                    # A server without Multiplex (an older router): nothing ran; a call per request from now on.
                    self._multiplex = None
                    method = self._stub.Chat if isinstance(request, tandem_pb2.ChatRequest) else self._stub.Generate
                    async for chunk in self._stream(method, request):
                        yield chunk
                    return
                if not chunks:
                    return
                for msg in chunks:
                    yield _chunk(msg)
        finally:
            call.cancel()   # no-op when it ended; aborts it if the caller stopped early

    async def _stream(self, method, request) -> AsyncIterator[Chunk]:
        call = method(request, metadata=self._metadata, timeout=self.timeout_s)
        try:
            async for msg in call:
                yield _chunk(msg)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    def generate_stream(self, prompt: str | Sequence[int], request_id: str = "", **sampling) -> AsyncIterator[Chunk]:
        request = _completion_request(prompt, self.model, request_id, sampling)
        if self._multiplex is not None:
            return self._multiplexed(request)
        return self._stream(self._stub.Generate, request)

    async def generate(self, prompt: str | Sequence[int], request_id: str = "", **sampling) -> Completion:
        return _join([c async for c in self.generate_stream(prompt, request_id, **sampling)])

    def chat_stream(self, messages: Sequence[dict], request_id: str = "", *, tools: Sequence[dict] | None = None,
                    tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
                    **sampling) -> AsyncIterator[Chunk]:
        request = _chat_request(messages, self.model, request_id, sampling, tools, tool_choice, parallel_tool_calls)
        if self._multiplex is not None:
            return self._multiplexed(request)
        return self._stream(self._stub.Chat, request)

    async def chat(self, messages: Sequence[dict], request_id: str = "", **options) -> Completion:
        """``options``: sampling keywords and ``tools``, ``tool_choice``, ``parallel_tool_calls``."""
        return _join([c async for c in self.chat_stream(messages, request_id, **options)])

    async def _unary(self, method, request):
        try:
            return await method(request, metadata=self._metadata, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def models(self) -> list[tandem_pb2.ModelInfo]:
        return list((await self._unary(self._stub.ListModels, tandem_pb2.ListModelsRequest())).models)

    async def cluster(self) -> list[tandem_pb2.WorkerStatus]:
        return list((await self._unary(self._stub.GetCluster, tandem_pb2.GetClusterRequest())).workers)

    async def close(self) -> None:
        if self._multiplex is not None:
            await self._multiplex.close()
        await self._channel.close()

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
