"""Tool calling end to end on the real SmolLM2-135M-Instruct: a router started with no tool
flags (the hermes parser picked from the chat template, auto tool choice on by default) over a
real prefill and a real decode worker process, driven by the official openai client.
SmolLM2-135M's template renders no tools, so the router describes them; a named or ``required``
tool_choice is forced by the structured-output grammar, which makes the call reliable even on a
model this small. Two turns: call (forced), tool result, answer; and two with tool_choice left
at its default."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.router.clusters import real_cluster

pytestmark = pytest.mark.slow
NAME = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(smollm2_gguf, tmp_path_factory, loop_thread):
    logs = tmp_path_factory.mktemp("tools-smollm2")
    for router, _ in real_cluster(loop_thread, smollm2_gguf, ("prefill", "decode"), logs, NAME,
                                  "--num-gpu-blocks-override", "128", "--max-model-len", "2048"):
        yield openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="x", max_retries=0, timeout=300)


def test_two_turn_conversation_with_a_forced_call(client):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the weather like in Paris today?"}]
    first = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER, TIME], max_tokens=80,
                                           temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])

    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"city": arguments["city"], "temperature": 18, "unit": arguments["unit"],
                                            "sky": "sunny"})})
    second = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                            temperature=0, tool_choice="none")
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert answer.message.content and answer.message.content.strip()
    print("call:", call.function.arguments, "| answer:", answer.message.content)


def test_required_choice_streamed_over_seeds(client):
    """Sampled at temperature 1, one call at most (parallel_tool_calls=false) whose strings are
    bounded by the schema, so 120 tokens always hold it: every answer is one valid call."""
    names = []
    for seed in range(3):
        chunks = list(client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "What time is it in Tokyo, and is it raining there?"}],
            tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=120,
            temperature=1.0, seed=seed, stream=True))
        calls: dict[int, dict] = {}
        for chunk in chunks:
            for delta in chunk.choices[0].delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls" and list(calls) == [0]
        tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0]["name"]]
        jsonschema.validate(json.loads(calls[0]["arguments"]), tool["function"]["parameters"])
        assert not "".join(c.choices[0].delta.content or "" for c in chunks)
        names.append(calls[0]["name"])
    print("required calls:", names)


def test_default_tool_choice_two_turns(client):
    """tool_choice left at its default ("auto") on both turns, as agent frameworks send it: 200s
    whose calls (if the 135M model makes any) are well-formed and whose finish_reason says which."""
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    for _ in range(2):
        out = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                             temperature=0)
        choice = out.choices[0]
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == ("tool_calls" if calls else choice.finish_reason)
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert all(c.function.name in ("get_weather", "get_time") and isinstance(json.loads(c.function.arguments),
                                                                                  dict) for c in calls)
        messages.append(choice.message.model_dump(exclude_none=True))
        if calls:
            messages += [{"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 18}'} for c in calls]
        else:
            messages.append({"role": "user", "content": "Please check the weather tool."})
        print("turn:", choice.finish_reason, [(c.function.name, c.function.arguments) for c in calls],
              choice.message.content)
