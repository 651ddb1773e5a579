"""A fake decode worker that answers with scripted text (router tests of output parsing).

``ScriptedDecode`` streams the tokens of the next scripted reply, a few per message, then
finishes with ``stop`` (or ``length`` if max_tokens cuts it), and records every prompt and sampling it got
so a test can read what the chat template produced and how the output was constrained. Used in place of
FakeDecode's token formula where the router must read the text (tool calls, tests/router/test_tool_calling.py).
"""
from __future__ import annotations

from collections import deque

from protos.tandem.v1 import worker_pb2
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
