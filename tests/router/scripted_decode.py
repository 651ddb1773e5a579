"""A fake decode worker that answers with scripted text (router tests of output parsing).

``ScriptedDecode`` streams the tokens of the next scripted reply, a few per message, then
finishes with ``stop`` (or ``length`` if max_tokens cuts it), and records every prompt and sampling it got
so a test can read what the chat template produced and how the output was constrained. Used in place of
FakeDecode's token formula where the router must read the text (tool calls, tests/router/test_tool_calling.py).
``scripted_router`` puts a router over a fake prefill and a scripted decode worker; ``script`` queues replies;
the tools and replies below are the hermes-format conversation the tool-calling tests share.
"""
from __future__ import annotations

import contextlib
from collections import deque

from protos.tandem.v1 import worker_pb2
from router.config import RouterConfig
from router.server import Router
from tests.router.clusters import MODEL
from tests.router.fake_workers import FakeDecode, FakeState, FakeWorker


class ScriptedDecode(FakeDecode):
    def __init__(self, state: FakeState, tokens_per_message: int = 3) -> None:
        super().__init__(state)
        self.replies: deque[list[int]] = deque()
        self.prompts: list[list[int]] = []
        self.sampling: list[worker_pb2.SamplingParams] = []
        self.tokens_per_message = tokens_per_message

    async def generate_one(self, request, context):
        self.state.seen.append(request.request_id)
        self.prompts.append(list(request.prompt_token_ids))
        self.sampling.append(request.sampling)
        tokens = self.replies.popleft()
        params = request.sampling
        max_tokens = params.max_tokens if params.HasField("max_tokens") else len(tokens)
        tokens, finish = (tokens, "stop") if len(tokens) <= max_tokens else (tokens[:max_tokens], "length")
        step = self.tokens_per_message
        for start in range(0, len(tokens), step):
            response = worker_pb2.GenerateResponse(token_ids=tokens[start:start + step])
            if start + step >= len(tokens):
                response.finish_reason = finish
                response.num_prompt_tokens = len(request.prompt_token_ids)
                response.num_output_tokens = len(tokens)
            yield response


def scripted_decode_worker(tokens_per_message: int = 3, max_model_len: int = 4096) -> FakeWorker:
    worker = FakeWorker("decode", max_model_len=max_model_len)
    worker.servicer = ScriptedDecode(worker.state, tokens_per_message)
    return worker


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string"}}}}}
CALL_REPLY = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
              '{"timezone": "Europe/Paris"}}\n</tool_call>')
ANSWER_REPLY = "It is 18 degrees Celsius in Paris right now."


@contextlib.contextmanager
def scripted_router(loop_thread, tokenizer, **router_options):
    """A router over a fake prefill and a scripted decode worker: (router, the decode servicer)."""
    async def start():
        prefill = await FakeWorker("prefill", max_model_len=4096).start()
        decode = await scripted_decode_worker().start()
        config = RouterConfig(model=MODEL, http_port=0, grpc_port=0, prefill=(prefill.address,),
                              decode=(decode.address,), heartbeat_interval_s=0.2, **router_options)
        router = await Router(config, tokenizer).start()
        await router.registry.wait_healthy("prefill", 1)
        await router.registry.wait_healthy("decode", 1)
        return router, prefill, decode

    router, prefill, decode = loop_thread.run(start())
    try:
        yield router, decode.servicer
    finally:
        async def stop():
            await router.stop()
            await prefill.stop()
            await decode.stop()
        loop_thread.run(stop())


def script(decode, tokenizer, *replies: str) -> None:
    decode.replies.extend(tokenizer.encode(r, add_special_tokens=False) for r in replies)
