"""Hostile gRPC requests the router must refuse with a status naming the field, and the size
limits its test clusters run with: shared by the unary (test_hostile_requests.py) and the
multiplexed (test_multiplex.py) front ends, so both refuse the same cases the same way."""
from __future__ import annotations

import grpc

from protos.tandem.v1 import tandem_pb2

LIMITS = {"max_sub_requests": 8, "max_prompt_chars": 100_000, "max_request_body_bytes": 256 << 10}


def completion_request(**fields) -> tandem_pb2.CompletionRequest:
    sampling = fields.pop("sampling", {})
    return tandem_pb2.CompletionRequest(prompt=fields.pop("prompt", "hi"), sampling=tandem_pb2.Sampling(**sampling),
                                        **fields)


def chat_request(messages, **sampling) -> tandem_pb2.ChatRequest:
    return tandem_pb2.ChatRequest(messages=[tandem_pb2.ChatMessage(role=r, content=c) for r, c in messages],
                                  sampling=tandem_pb2.Sampling(**sampling))


# (case, method, request, code, the field the message starts with or names)
GRPC_CASES = [
    ("prompt-and-token-ids", "Generate", completion_request(prompt_token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt"),
    ("temperature-nan", "Generate", completion_request(sampling={"temperature": float("nan")}),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("temperature-inf", "Generate", completion_request(sampling={"temperature": float("inf")}),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("top-p-zero", "Generate", completion_request(sampling={"top_p": 0.0}), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("repetition-penalty-denormal", "Generate", completion_request(sampling={"repetition_penalty": 1e-40}),
     grpc.StatusCode.INVALID_ARGUMENT, "repetition_penalty"),
    ("stop-token-id-past-vocab", "Generate", completion_request(sampling={"stop_token_ids": [2**63 - 1]}),
     grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
    ("too-many-stop-token-ids", "Chat", chat_request([("user", "x")], stop_token_ids=list(range(200))),
     grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
    ("too-many-stop-strings", "Generate", completion_request(sampling={"stop": ["a"] * 17}),
     grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ("seed-negative", "Generate", completion_request(sampling={"seed": -1}), grpc.StatusCode.INVALID_ARGUMENT, "seed"),
    ("max-tokens-negative", "Chat", chat_request([("user", "x")], max_tokens=-5), grpc.StatusCode.INVALID_ARGUMENT,
     "max_tokens"),
    ("token-id-past-vocab", "Generate", completion_request(prompt="", prompt_token_ids=[10**12]),
     grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ("request-id-too-long", "Generate", completion_request(request_id="r" * 300), grpc.StatusCode.INVALID_ARGUMENT,
     "request_id"),
    ("chat-empty", "Chat", chat_request([]), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
    ("chat-over-char-cap", "Chat", chat_request([("user", "y" * 60_000)] * 2), grpc.StatusCode.INVALID_ARGUMENT,
     "max_prompt_chars"),
    ("unknown-model", "Generate", completion_request(model="gpt-9"), grpc.StatusCode.NOT_FOUND, "gpt-9"),
]
