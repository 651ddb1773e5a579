"""In-process twins of the prefill and decode workers, for router tests and the router benchmark.

Real grpc.aio servers on port 0 speaking worker.proto, so the router talks to them exactly as
to real workers (on their Session streams). The fake decode worker makes one token per
``token_interval_s`` for each open request, a deterministic function of the sequence so far
(``next_token``), so a request resumed from prompt + generated tokens continues with the same
tokens, like a greedy model. Tokens are made in steps, like the real decode worker's engine
steps: one timer makes a token for every open request, starting when one opens on an idle worker.
A request's ``generate_one`` hands over everything made since its last message in one
GenerateResponse -- one token while the reader keeps up, several when it lags -- and a Session
sends every one of its requests' new tokens in one DecodeSessionResponse.
``kv_blocks_used`` is the number of open streams, so "no blocks left in use" can be asserted.
No torch, no engine.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

FIRST_FAKE_TOKEN = 1000
NUM_FAKE_TOKENS = 4000


def next_token(seq: Sequence[int]) -> int:
    return FIRST_FAKE_TOKEN + (seq[-1] * 31 + len(seq) * 17) % NUM_FAKE_TOKENS


def fake_completion(prompt_token_ids: Sequence[int], num_tokens: int) -> list[int]:
    seq = list(prompt_token_ids)
    for _ in range(num_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt_token_ids):]


@dataclass
class FakeState:
    model: str = "fake-model"
    max_model_len: int = 256
    fingerprint: str = ""             # none: the router does not check the model (engine/fingerprint.py)
    kv_blocks_total: int = 1000
    active: set[str] = field(default_factory=set)
    seen: list[str] = field(default_factory=list)        # request ids, in arrival order
    aborted: list[str] = field(default_factory=list)
    local_prefill: list[str] = field(default_factory=list)   # decode: asked to prefill these itself
    num_sessions: int = 0             # Session streams opened

    def stats(self, role: str) -> worker_pb2.StatsResponse:
        return worker_pb2.StatsResponse(role=role, num_running=len(self.active), kv_blocks_used=len(self.active),
                                        kv_blocks_total=self.kv_blocks_total, model=self.model,
                                        max_model_len=self.max_model_len, fingerprint=self.fingerprint)


class FakePrefill(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, state: FakeState) -> None:
        self.state = state

    async def Session(self, request_iterator, context):
        """Submits answered at once, aborts recorded like Abort calls."""
        self.state.num_sessions += 1
        async for message in request_iterator:
            results = []
            for request in message.submit:
                self.state.seen.append(request.request_id)
                results.append(worker_pb2.SubmitResponse(request_id=request.request_id))
            self.state.aborted.extend(message.abort)
            if results:
                yield worker_pb2.PrefillSessionResponse(results=results)

    async def SetDestination(self, request, context):
        return worker_pb2.SetDestinationResponse()

    async def Abort(self, request, context):
        self.state.aborted.append(request.request_id)
        await context.abort(grpc.StatusCode.NOT_FOUND, "fake prefill keeps nothing")

    async def Stats(self, request, context):
        return self.state.stats("prefill")


@dataclass(eq=False)
class _FakeStream:
    """One request's tokens: the steps append them, its ``generate_one`` hands them over."""

    seq: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    fail_after_tokens: int | None
    pending: list[int] = field(default_factory=list)   # made, not yet sent
    num_made: int = 0
    finish_reason: str | None = None
    failed: bool = False
    waiter: asyncio.Future | None = None

    def step(self) -> bool:
        """Make the next token (or fail); False once the stream makes no more."""
        if self.fail_after_tokens is not None and self.num_made >= self.fail_after_tokens:
            self.failed = True
        else:
            token = next_token(self.seq)
            self.seq.append(token)
            self.pending.append(token)
            self.num_made += 1
            if token in self.stop_token_ids and not self.ignore_eos:
                self.finish_reason = "stop"
            elif self.num_made >= self.max_tokens:
                self.finish_reason = "length"
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)
        return not (self.failed or self.finish_reason)

    async def take(self) -> list[int]:
        """The tokens made since the last call (waits for one, or for the end)."""
        while not (self.pending or self.finish_reason or self.failed):
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        tokens, self.pending = self.pending, []
        return tokens


class FakeDecode(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, state: FakeState, token_interval_s: float = 0.0, fail_after_tokens: int | None = None) -> None:
        self.state = state
        self.token_interval_s = token_interval_s
        self.fail_after_tokens = fail_after_tokens   # end each stream with UNAVAILABLE after this many
        self.fail_transient = False                  # ... marked as its KV transfer's failure (Session)
        self.stats_delay_s = 0.0                     # a slow (or, with a large value, hung) Stats
        self.stats_gone = False                      # Stats answers UNAVAILABLE (engine thread dead)
        self.refused_token: int | None = None        # a prompt holding it is refused (INVALID_ARGUMENT)
        self._generating: dict[str, _FakeStream] = {}
        self._next_step: asyncio.TimerHandle | None = None

    def _step(self) -> None:
        """One engine step: a token for every generating stream; the next step follows while any is left."""
        for rid, stream in list(self._generating.items()):
            if not stream.step():
                del self._generating[rid]
        self._next_step = None
        self._schedule_step()

    def _schedule_step(self) -> None:
        if self._next_step is None and self._generating:
            self._next_step = asyncio.get_running_loop().call_later(self.token_interval_s, self._step)

    def _open(self, request) -> _FakeStream:
        rid = request.request_id
        self.state.active.add(rid)
        self.state.seen.append(rid)
        if request.local_prefill:
            self.state.local_prefill.append(rid)
        params = request.sampling
        stream = _FakeStream(list(request.prompt_token_ids), params.max_tokens if params.HasField("max_tokens") else 16,
                             frozenset(params.stop_token_ids), params.ignore_eos, self.fail_after_tokens)
        self._generating[rid] = stream
        self._schedule_step()
        return stream

    def _close(self, rid: str) -> None:
        self._generating.pop(rid, None)
        self.state.active.discard(rid)

    @staticmethod
    def _response(request, stream: _FakeStream, tokens: list[int]) -> worker_pb2.GenerateResponse:
        params = request.sampling
        response = worker_pb2.GenerateResponse(token_ids=tokens)
        if params.HasField("logprobs"):
            response.logprobs.extend(_fake_logprobs(t, params.logprobs) for t in tokens)
        if stream.finish_reason is not None and not stream.pending:
            response.finish_reason = stream.finish_reason
            response.num_prompt_tokens = len(request.prompt_token_ids)
            response.num_output_tokens = stream.num_made
        return response

    async def generate_one(self, request, context: _SessionContext):
        """One request's GenerateResponse messages; ``context.abort`` refuses or fails it."""
        rid = request.request_id
        if rid in self.state.active:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id={rid!r} is running")
        if self.refused_token in request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token {self.refused_token} is refused")
        stream = self._open(request)
        try:
            while True:
                tokens = await stream.take()
                if stream.failed and not tokens:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake decode failure")
                response = self._response(request, stream, tokens)
                yield response
                if response.finish_reason:
                    return
        finally:
            self._close(rid)

    async def Session(self, request_iterator, context):
        """The real worker's Session (decode_worker/servicer.py) over this servicer's own
        ``generate_one`` (so subclasses that script it serve sessions too): every request's messages since
        the last one leave together -- one step's tokens for all of them in one message; aborts
        on the stream are recorded like Abort calls."""
        self.state.num_sessions += 1
        outputs: list[worker_pb2.GenerateResponse] = []
        wake = asyncio.Event()
        running: dict[str, asyncio.Task] = {}

        async def run(request) -> None:
            rid = request.request_id
            try:
                async for response in self.generate_one(request, _SessionContext()):
                    response.request_id = rid
                    outputs.append(response)
                    wake.set()
            except _Refused as exc:
                outputs.append(worker_pb2.GenerateResponse(request_id=rid, error_code=exc.code.value[0],
                                                           error=exc.details, error_transient=self.fail_transient))
                wake.set()
            finally:
                if running.get(rid) is asyncio.current_task():
                    del running[rid]

        async def read() -> None:
            async for message in request_iterator:
                for request in message.generate:
                    running[request.request_id] = asyncio.get_running_loop().create_task(run(request))
                for rid in message.abort:
                    self.state.aborted.append(rid)
                    task = running.pop(rid, None)
                    if task is not None:
                        task.cancel()

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while not reader.done() or running or outputs:
                if not outputs:
                    wake.clear()
                    waiter = asyncio.ensure_future(wake.wait())
                    await asyncio.wait([waiter, reader], return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    await asyncio.sleep(0)   # let every stream woken by the same step add its tokens
                if outputs:
                    response = worker_pb2.DecodeSessionResponse(outputs=outputs)
                    outputs.clear()   # before the yield: streams add to it while the message is sent
                    yield response
        finally:
            reader.cancel()
            for task in running.values():
                task.cancel()

    async def Abort(self, request, context):
        self.state.aborted.append(request.request_id)
        if request.request_id not in self.state.active:
            await context.abort(grpc.StatusCode.NOT_FOUND, "not running")
        return worker_pb2.AbortResponse()

    async def Stats(self, request, context):
        await asyncio.sleep(self.stats_delay_s)
        if self.stats_gone:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine thread is not running")
        return self.state.stats("decode")


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _SessionContext:
    """What ``generate_one`` gets when it serves one request of a Session: ``abort`` ends that request alone."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Refused(code, details)


def _fake_logprobs(token: int, k: int) -> worker_pb2.TokenLogprobs:
    top = [token] + [FIRST_FAKE_TOKEN + j for j in range(k) if FIRST_FAKE_TOKEN + j != token]
    return worker_pb2.TokenLogprobs(token_id=token, logprob=-0.5, top_token_ids=top[:max(k, 0)],
                                    top_logprobs=[-0.5 - i for i in range(min(len(top), k))])


class FakeWorker:
    """A fake worker's server; ``address`` once started. ``stop()`` is the twin of a dead process."""

    def __init__(self, role: str, **options) -> None:
        self.role = role
        self.state = FakeState(**{k: options.pop(k) for k in ("model", "max_model_len", "fingerprint")
                                  if k in options})
        self.servicer = FakePrefill(self.state) if role == "prefill" else FakeDecode(self.state, **options)
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self, host: str = "127.0.0.1") -> FakeWorker:
        self.server = grpc.aio.server()
        add = (worker_pb2_grpc.add_PrefillWorkerServicer_to_server if self.role == "prefill"
               else worker_pb2_grpc.add_DecodeWorkerServicer_to_server)
        add(self.servicer, self.server)
        port = self.server.add_insecure_port(f"{host}:0")
        await self.server.start()
        self.address = f"{host}:{port}"
        return self

    async def stop(self, grace_s: float | None = None) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None
