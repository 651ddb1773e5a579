"""What both public APIs call (router process): validate, tokenize, dispatch, detokenize, stop.

``Frontend.prepare_*`` turns a public request into a ``PreparedRequest`` (or raises
RouterError); they template and tokenize, so the APIs call them off the event loop
(``asyncio.to_thread``) and a huge request never stalls the others or ``/health``.
``Frontend.admit`` then refuses a request whose sub-requests would overfill the waiting queue or
miss the latency limits (429; router/admission.py). ``Frontend.stream`` yields ``TextChunk``s:
text deltas with their token ids, the last one with finish_reason and usage. Closing the stream
early (client gone) or a stop string aborts the request at both workers through the dispatcher.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import jinja2

from engine.config import DEFAULT_MAX_TOKENS
from engine.tokenizer import Tokenizer
from protos.limits import MAX_CLIENT_REQUEST_ID_CHARS, ROLES
from protos.tandem.v1 import tandem_pb2, worker_pb2
from router import errors
from router.admission import DecodePace
from router.config import RouterConfig
from router.dispatch import Dispatch, Dispatcher
from router.metrics import RouterMetrics
from router.registry import WorkerRegistry
from router.sampling import prepare_sampling, unencodable
from router.text_stream import TextStream
from router.tool_calls import ToolCall
from router.tool_choice import ToolRequest, prompt_inputs
from router.tool_formats import ToolFormat

MAX_PROMPT_TOKEN_IDS = 1 << 20   # a prompt_token_ids list before any worker told max_model_len
MAX_CHAT_MESSAGES = 4096         # messages in one chat request

@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: worker_pb2.SamplingParams
    stop: tuple[str, ...]
    keep_token_ids: frozenset[int] = frozenset()   # special tokens kept in the text (tool-call markers)
    tools: ToolRequest | None = None               # a chat request's tools: how its output is read


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class TextChunk:
    text: str
    token_ids: list[int]
    logprobs: list[worker_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)   # read out of the text by a tool-call parser


class Frontend:
    def __init__(self, tokenizer: Tokenizer, registry: WorkerRegistry, dispatcher: Dispatcher,
                 metrics: RouterMetrics, config: RouterConfig) -> None:
        self.tokenizer = tokenizer
        self.registry = registry
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.model_name = config.model_name
        self.max_waiting = config.max_waiting
        self.max_predicted_wait_s = config.max_predicted_wait_s
        self.max_tpot_s = config.max_tpot_s
        self.decode_pace = DecodePace()
        self.max_sub_requests = config.max_sub_requests
        self.max_prompt_chars = config.max_prompt_chars
        self.tool_format = ToolFormat.resolve(config.tool_call_parser, config.enable_auto_tool_choice, tokenizer)

    # -- preparing --------------------------------------------------------------------------

    @staticmethod
    def new_request_id() -> str:
        """The id of a request whose client gave none: 96 random bits (half a microsecond), so
        no one guesses another client's id from their own. It stays apart from the workers' id
        (``Dispatcher.open``): this one is the client's, shown to it; that one is made from any
        client's id, given or made here, since a client may reuse its own."""
        return os.urandom(12).hex()

    def check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise errors.model_not_found(model, self.model_name)

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        """Before any tokenizing: one request may not ask for more than max_sub_requests streams."""
        if num_prompts * n > self.max_sub_requests:
            raise errors.invalid_request(f"{num_prompts} prompts x n={n} is {num_prompts * n} completions, more than "
                                         f"max_sub_requests={self.max_sub_requests}", "n" if n > 1 else "prompt")

    def _request_id(self, given: str) -> str:
        if len(given) > MAX_CLIENT_REQUEST_ID_CHARS:
            raise errors.invalid_request(f"request_id is longer than {MAX_CLIENT_REQUEST_ID_CHARS} characters",
                                         "request_id")
        if unencodable(given):
            raise errors.invalid_request("request_id must be valid Unicode (no lone surrogates)", "request_id")
        if not given.isprintable():   # the id goes end to end into every log line about the request
            raise errors.invalid_request(f"request_id must hold printable characters only, got '{errors.clip(given)}'",
                                         "request_id")
        return given or self.new_request_id()

    def prepare_prompt(self, prompt: str, prompt_token_ids: Sequence[int], sampling: tandem_pb2.Sampling,
                       request_id: str = "",
                       default_max_tokens: int | None = DEFAULT_MAX_TOKENS) -> PreparedRequest:
        if bool(prompt) == bool(prompt_token_ids):
            raise errors.invalid_request("give exactly one of prompt (text) and prompt_token_ids", "prompt")
        request_id = self._request_id(request_id)
        if prompt:
            if len(prompt) > self.max_prompt_chars:
                raise errors.invalid_request(f"the prompt is longer than max_prompt_chars={self.max_prompt_chars} "
                                             "characters", "prompt")
            if unencodable(prompt):
                raise errors.invalid_request("the prompt must be valid Unicode (no lone surrogates)", "prompt")
            token_ids = self.tokenizer.encode(prompt)
        else:
            self._check_num_prompt_tokens(len(prompt_token_ids))   # before the list is built element by element
            token_ids = [int(t) for t in prompt_token_ids]
            vocab = self.tokenizer.vocab_size
            if min(token_ids) < 0 or max(token_ids) >= vocab:
                bad = next(t for t in token_ids if not 0 <= t < vocab)
                raise errors.invalid_request(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        if not token_ids:
            raise errors.invalid_request("the prompt is empty", "prompt")
        return self._prepare(token_ids, sampling, request_id, default_max_tokens)

    def _check_num_prompt_tokens(self, num_tokens: int) -> None:
        max_model_len = self.registry.max_model_len
        if max_model_len is not None and num_tokens >= max_model_len:
            raise errors.invalid_request(f"This model's maximum context length is {max_model_len} tokens, but the "
                                         f"prompt has {num_tokens} tokens; shorten the prompt", "prompt")
        if num_tokens > MAX_PROMPT_TOKEN_IDS:
            raise errors.invalid_request(f"the prompt has {num_tokens} token ids, more than the router takes "
                                         f"({MAX_PROMPT_TOKEN_IDS})", "prompt")

    @staticmethod
    def check_num_messages(num_messages: int) -> None:
        if not num_messages:
            raise errors.invalid_request("messages is empty", "messages")
        if num_messages > MAX_CHAT_MESSAGES:
            raise errors.invalid_request(f"{num_messages} messages, more than the {MAX_CHAT_MESSAGES} one chat "
                                         "request may hold", "messages")

    def tool_request(self, tools: list[dict], tool_choice: str | dict | None,
                     parallel_tool_calls: bool | None) -> ToolRequest | None:
        """What a chat request's tools mean here (router/tool_choice.py); RouterError 400 if they cannot hold."""
        return ToolRequest.from_openai(tools, tool_choice, parallel_tool_calls, self.tool_format)

    def prepare_chat(self, messages: list[dict], sampling: tandem_pb2.Sampling, request_id: str = "",
                     default_max_tokens: int | None = None, tools: ToolRequest | None = None) -> PreparedRequest:
        """``tools`` go to the chat template, or are described in the messages when it renders none
        (router/tool_choice.py); a request whose output a parser reads keeps its markers."""
        self.check_num_messages(len(messages))
        messages, template_tools = prompt_inputs(messages, tools, self.tokenizer.template_takes_tools,
                                                 self.tool_format.parser_name)
        prepared = self._prepare_chat(messages, sampling, request_id, default_max_tokens, template_tools)
        if tools is None:
            return prepared
        keep = self.tool_format.marker_token_ids if not tools.forced else frozenset()
        return dataclasses.replace(prepared, keep_token_ids=keep, tools=tools)

    def _prepare_chat(self, messages: list[dict], sampling: tandem_pb2.Sampling, request_id: str,
                      default_max_tokens: int | None, tools: list[dict] | None) -> PreparedRequest:
        request_id = self._request_id(request_id)
        num_chars = len(json.dumps(tools)) if tools else 0
        for i, message in enumerate(messages):
            for key, value in message.items():
                if key == "tool_calls":   # checked by the HTTP API's types (router/openai_types.py)
                    num_chars += len(json.dumps(value))
                    continue
                if not isinstance(value, str):
                    raise errors.invalid_request(f"messages.{i}.{key} must be a string", f"messages.{i}.{key}")
                if unencodable(value):
                    raise errors.invalid_request(f"messages.{i}.{key} must be valid Unicode (no lone surrogates)",
                                                 f"messages.{i}.{key}")
                num_chars += len(value)
        if num_chars > self.max_prompt_chars:
            raise errors.invalid_request(f"the messages hold {num_chars} characters, more than max_prompt_chars="
                                         f"{self.max_prompt_chars}", "messages")
        try:
            token_ids = self.tokenizer.encode_chat(messages, tools=tools)
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise errors.invalid_request(f"the chat template refused the messages: {errors.clip(str(exc), 256)}",
                                         "messages") from None
        return self._prepare(token_ids, sampling, request_id, default_max_tokens)

    def _prepare(self, token_ids: list[int], sampling: tandem_pb2.Sampling, request_id: str,
                 default_max_tokens: int | None) -> PreparedRequest:
        prepared = prepare_sampling(sampling, len(token_ids), self.registry.max_model_len, default_max_tokens,
                                    self.tokenizer.vocab_size)
        return PreparedRequest(request_id, token_ids, prepared.params, prepared.stop)

    def admit(self, requests: Sequence[PreparedRequest]) -> None:
        """Raise before streaming starts if the request's sub-requests (prompts x n) cannot be
        taken now (429 / 503). They all count against max_waiting; with max_predicted_wait_s
        their prompt tokens join the queue's in the predicted wait for a first token, and with
        max_tpot_s none is taken while the running streams are slower than that
        (router/admission.py). On an empty queue the queue's limits take any request that passed
        check_fan_out, so a small limit never starves it. The queue is the dispatcher's: a
        request admitted a moment ago whose streams have not started yet is not in it, so a
        burst can overshoot by about one request's sub-requests."""
        # With local prefill on, a short prompt needs a decode worker only (the dispatcher refuses
        # a long one when no prefill worker is left).
        for role in ("decode",) if self.dispatcher.local_prefill_max_tokens else ROLES:
            if not self.registry.healthy(role):
                raise errors.unavailable(f"no {role} worker is available")
        queue = self.dispatcher.waiting
        if queue.num_requests:
            if queue.num_requests + len(requests) > self.max_waiting:
                self._refuse("max_waiting", errors.overloaded(queue.num_requests, self.max_waiting, len(requests)))
            if self.max_predicted_wait_s:
                num_tokens = sum(len(r.prompt_token_ids) for r in requests)
                wait_s = queue.predicted_wait_s(num_tokens, len(requests))
                if wait_s is not None and wait_s > self.max_predicted_wait_s:
                    self._refuse("max_predicted_wait_s", errors.wait_too_long(
                        wait_s, self.max_predicted_wait_s, queue.num_tokens, num_tokens))
        if self.max_tpot_s:
            pace_s = self.decode_pace.seconds_per_token()
            if pace_s is not None and pace_s > self.max_tpot_s:
                self._refuse("max_tpot_s", errors.decode_too_slow(pace_s, self.max_tpot_s))

    def _refuse(self, limit: str, exc: errors.RouterError) -> NoReturn:
        self.metrics.refused.labels(limit).inc()
        self.metrics.errors.labels(str(exc.http_status)).inc()
        raise exc

    # -- streaming --------------------------------------------------------------------------

    def open(self, request: PreparedRequest) -> Dispatch:
        """Start dispatching ``request`` now, before its ``stream`` runs (Multiplex does, so the
        start leaves in this turn of the loop); raises RouterError. Pass the result to
        ``stream``, or to ``abandon`` if the stream never runs."""
        try:
            dispatch = self.dispatcher.open(request.request_id, request.prompt_token_ids, request.params)
        except errors.RouterError as exc:
            self.metrics.errors.labels(str(exc.http_status)).inc()
            raise
        self.metrics.prompt_tokens_arrived.inc(len(request.prompt_token_ids))
        self.metrics.max_tokens_arrived.inc(request.params.max_tokens)
        return dispatch

    def abandon(self, dispatch: Dispatch) -> None:
        self.dispatcher.abandon(dispatch)

    async def stream(self, request: PreparedRequest, dispatch: Dispatch | None = None
                     ) -> AsyncGenerator[TextChunk, None]:
        """One chunk per dispatcher event: every token that arrived while the previous chunk was
        being written goes out in the next one (the decode session holds them: SessionCall.take).
        ``dispatch``: the request as ``open`` started it (else the stream opens it)."""
        if dispatch is None:
            dispatch = self.open(request)
        text = TextStream(self.tokenizer, request.stop, request.keep_token_ids)
        start_s = last_s = first_s = time.perf_counter()
        num_output_tokens = 0
        events = self.dispatcher.events(dispatch)
        self.metrics.running.inc()
        self.decode_pace.num_streams += 1
        try:
            async for last in events:
                token_ids, logprobs = last.token_ids, last.logprobs
                now_s = time.perf_counter()
                if token_ids:
                    (self.metrics.ttft if num_output_tokens == 0 else self.metrics.itl).observe(now_s - last_s)
                    if num_output_tokens:
                        self.decode_pace.add(now_s - last_s, len(token_ids))
                    first_s = now_s if num_output_tokens == 0 else first_s
                    last_s = now_s
                    num_output_tokens += len(token_ids)
                delta = text.add(token_ids)
                finish = "stop" if text.stopped else last.finish_reason
                if finish is None:
                    yield TextChunk(delta, token_ids, logprobs)
                    continue
                if not text.stopped:
                    delta += text.finish()
                usage = Usage(len(request.prompt_token_ids), num_output_tokens, last.num_cached_tokens)
                self._count_finish(finish, usage, now_s - start_s, request.params.max_tokens)
                if num_output_tokens > 1:
                    self.metrics.tpot.observe((now_s - first_s) / (num_output_tokens - 1))
                yield TextChunk(delta, token_ids, logprobs, finish, usage)
                return
        except errors.RouterError as exc:
            self.metrics.errors.labels(str(exc.http_status)).inc()
            raise
        finally:
            self.metrics.running.dec()
            self.decode_pace.num_streams -= 1
            await events.aclose()   # an unfinished request is aborted at its workers
            self.dispatcher.abandon(dispatch)   # ... and so is one whose events never began

    def _count_finish(self, finish: str, usage: Usage, latency_s: float, max_tokens: int) -> None:
        self.metrics.requests.labels(finish).inc()
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.generation_tokens.inc(usage.completion_tokens)
        self.metrics.max_tokens_finished.inc(max_tokens)
        self.metrics.e2e.observe(latency_s)
