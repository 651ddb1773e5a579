"""Tools on the gRPC Chat API (router/grpc_tools.py) through the SDK (tandem_client/), against
a router with no tool flags over a scripted decode worker: a two-turn conversation with
tool_choice at its default on Chat and on the async SDK's Multiplex stream, streamed chunks
carrying the calls, a forced named call, the wire types' round trip, and the 400s."""
from __future__ import annotations

import asyncio
import json

import pytest

from protos.tandem.v1 import tandem_pb2
from tandem_client import AsyncTandemClient, InvalidArgument, TandemClient
from tests.router.clusters import MODEL
from tests.router.scripted_decode import ANSWER_REPLY, CALL_REPLY, TIME_TOOL, WEATHER_TOOL, script, scripted_router

DEEP: dict = {}
for _ in range(200):
    DEEP = {"type": "object", "properties": {"x": DEEP}}
MESSAGES = [{"role": "user", "content": "What is the weather and the time in Paris?"}]


@pytest.fixture(scope="module")
def cluster(loop_thread, tokenizer):
    with scripted_router(loop_thread, tokenizer) as started:
        yield started


@pytest.fixture()
def decode(cluster):
    servicer = cluster[1]
    servicer.replies.clear()
    servicer.prompts.clear()
    servicer.sampling.clear()
    return servicer


@pytest.fixture()
def sdk(cluster):
    with TandemClient(cluster[0].grpc_address, model=MODEL) as client:
        yield client


def test_two_turn_tool_conversation(sdk, decode, tokenizer):
    script(decode, tokenizer, CALL_REPLY, ANSWER_REPLY)
    first = sdk.chat(MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=200)
    assert (first.finish_reason, first.text) == ("tool_calls", "I will look it up.")
    assert [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]
    assert all(c.id.startswith("call_") for c in first.tool_calls)
    assert json.dumps(WEATHER_TOOL) in tokenizer.decode(decode.prompts[0], skip_special_tokens=False)

    messages = MESSAGES + [{"role": "assistant", "content": first.text, "tool_calls": first.tool_calls_openai()},
                           {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"temperature": 18}'},
                           {"role": "tool", "tool_call_id": first.tool_calls[1].id, "content": '{"time": "14:05"}'}]
    second = sdk.chat(messages, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=200)
    assert (second.finish_reason, second.text, second.tool_calls) == ("stop", ANSWER_REPLY, [])
    prompt = tokenizer.decode(decode.prompts[1], skip_special_tokens=False)
    assert ('<|im_start|>assistant\nI will look it up.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>') in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 18}\n</tool_response><|im_end|>' in prompt


def test_streamed_chunks_carry_the_calls(sdk, decode, tokenizer):
    script(decode, tokenizer, CALL_REPLY)
    chunks = list(sdk.chat_stream(MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL]))
    assert "".join(c.text for c in chunks) == "I will look it up."
    assert [c.name for chunk in chunks for c in chunk.tool_calls] == ["get_weather", "get_time"]
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]
    assert sum(len(c.token_ids) for c in chunks) == len(tokenizer.encode(CALL_REPLY, add_special_tokens=False))


def test_multiplexed_sdk_reads_calls_too(cluster, decode, tokenizer):
    script(decode, tokenizer, CALL_REPLY)

    async def run():
        async with AsyncTandemClient(cluster[0].grpc_address, model=MODEL) as client:
            return await client.chat(MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL])
    out = asyncio.run(run())
    assert (out.finish_reason, [c.name for c in out.tool_calls]) == ("tool_calls", ["get_weather", "get_time"])


def test_tool_choice_none_and_named(sdk, decode, tokenizer):
    script(decode, tokenizer, CALL_REPLY, '{"city": "Oslo"}')
    out = sdk.chat(MESSAGES, tools=[WEATHER_TOOL], tool_choice="none")
    assert (out.text, out.tool_calls, out.finish_reason) == (CALL_REPLY, [], "stop")
    out = sdk.chat(MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    grammar = decode.sampling[1].grammar
    assert (grammar.kind, json.loads(grammar.spec)) == ("json_schema", WEATHER_TOOL["function"]["parameters"])
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Oslo"}')]


def test_tool_wire_types_round_trip():
    request = tandem_pb2.ChatRequest(
        messages=[tandem_pb2.ChatMessage(role="assistant", tool_calls=[tandem_pb2.ToolCall(id="call_1", name="f",
                                                                                          arguments='{"a": 1}')]),
                  tandem_pb2.ChatMessage(role="tool", content="ok", tool_call_id="call_1")],
        tools=[tandem_pb2.Tool(name="f", description="d", parameters='{"type": "object"}')],
        tool_choice="required", parallel_tool_calls=False)
    again = tandem_pb2.ChatRequest.FromString(request.SerializeToString())
    assert again == request and again.HasField("parallel_tool_calls") and not again.parallel_tool_calls
    chunk = tandem_pb2.CompletionChunk(finish_reason="tool_calls",
                                       tool_calls=[tandem_pb2.ToolCall(id="call_2", name="g", arguments="{}")])
    assert tandem_pb2.CompletionChunk.FromString(chunk.SerializeToString()) == chunk


@pytest.mark.parametrize("tools,kwargs,message", [
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], {},
     "tools[0].parameters must be a JSON Schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": DEEP}}], {},
     "tools[0].parameters must be a JSON Schema object as JSON text (nested at most 128 deep)"),
    ([WEATHER_TOOL], {"tool_choice": "sometimes"}, "tool_choice must be one of ('auto', 'none', 'required')"),
    ([WEATHER_TOOL], {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names function 'nope', which is not in tools"),
    ([WEATHER_TOOL, WEATHER_TOOL], {}, "two tools are named 'get_weather'"),
    ([{"type": "function", "function": {"name": ""}}], {}, "tool names are 1 to 64 characters"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], {}, "at most 128 tools, got 129"),
    ([], {"tool_choice": "required"}, 'tool_choice "required" needs tools'),
])
def test_bad_tools_are_invalid_argument(sdk, decode, tools, kwargs, message):
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        sdk.chat(MESSAGES, tools=tools, **kwargs)
    assert not decode.prompts


def test_both_tool_choice_fields_are_invalid_argument(cluster, decode):
    request = tandem_pb2.ChatRequest(messages=[tandem_pb2.ChatMessage(role="user", content="hi")],
                                     tools=[tandem_pb2.Tool(name="get_weather")], tool_choice="auto",
                                     tool_choice_function="get_weather")
    with TandemClient(cluster[0].grpc_address) as client:
        with pytest.raises(InvalidArgument, match="give tool_choice or tool_choice_function, not both"):
            list(client._stream(client._stub.Chat, request))
    assert not decode.prompts
