"""Tool calling over the OpenAI HTTP API, with the official openai client, against a fake
prefill worker and a decode worker scripted to answer like a hermes-format model
(tests/router/scripted_decode.py): a two-turn conversation (call, tool result, answer) with
tool_choice left at its default against a router started with no tool flags (the parser comes
from the chat template), streaming deltas equal to the non-streamed answer, tool_choice none /
named, the other formats through the router, and the 400s."""
from __future__ import annotations

import json
import re

import openai
import pytest

from engine.tokenizer import Tokenizer
from tests.router.clusters import MODEL
from tests.router.scripted_decode import ANSWER_REPLY, CALL_REPLY, TIME_TOOL, WEATHER_TOOL, script, scripted_router


@pytest.fixture(scope="module")
def cluster(loop_thread, tokenizer):
    with scripted_router(loop_thread, tokenizer) as started:   # no tool flags: tandem serve's defaults
        yield started


@pytest.fixture()
def client(cluster):
    router, _ = cluster
    return openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def decode(cluster, tokenizer):
    servicer = cluster[1]
    servicer.replies.clear()
    servicer.prompts.clear()
    servicer.sampling.clear()
    return servicer


def test_two_turn_tool_conversation(client, decode, tokenizer):
    script(decode, tokenizer, CALL_REPLY, ANSWER_REPLY)
    messages = [{"role": "user", "content": "What is the weather and the time in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris", "unit": "celsius"}),
        ("function", "get_time", {"timezone": "Europe/Paris"})]
    # SmolLM2-135M's template renders no tools: the router described them in a system message.
    prompt = tokenizer.decode(decode.prompts[0], skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nYou may call one or more functions")
    assert json.dumps(WEATHER_TOOL) in prompt and "What is the weather" in prompt

    messages.append(choice.message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 18}'},
                 {"role": "tool", "tool_call_id": calls[1].id, "content": '{"time": "14:05"}'}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL])
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == ANSWER_REPLY and not second.choices[0].message.tool_calls
    prompt = tokenizer.decode(decode.prompts[1], skip_special_tokens=False)
    assert ('<|im_start|>assistant\nI will look it up.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time"') in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 18}\n</tool_response><|im_end|>' in prompt


@pytest.mark.parametrize("tokens_per_message", [1, 3])
def test_streamed_tool_calls_equal_the_non_streamed_answer(client, decode, tokenizer, tokens_per_message):
    decode.tokens_per_message = tokens_per_message
    script(decode, tokenizer, CALL_REPLY, CALL_REPLY)
    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL])
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                                 stream=True))
    decode.tokens_per_message = 3
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert content == full.choices[0].message.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_malformed_call_is_content(client, decode, tokenizer):
    bad = "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>"
    script(decode, tokenizer, bad)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Paris?"}],
                                         tools=[WEATHER_TOOL])
    assert (out.choices[0].message.content, out.choices[0].message.tool_calls) == (bad, None)
    assert out.choices[0].finish_reason == "stop"


def test_tool_choice_none_neither_describes_nor_parses(client, decode, tokenizer):
    script(decode, tokenizer, CALL_REPLY)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Paris?"}],
                                         tools=[WEATHER_TOOL], tool_choice="none")
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (CALL_REPLY, "stop")
    assert "<tools>" not in tokenizer.decode(decode.prompts[0], skip_special_tokens=False)


def test_named_choice_is_forced_by_a_json_schema(client, decode, tokenizer):
    script(decode, tokenizer, '{"city": "Paris", "unit": "celsius"}')
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Paris?"}],
                                         tools=[WEATHER_TOOL, TIME_TOOL],
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    grammar = decode.sampling[0].grammar
    assert (grammar.kind, json.loads(grammar.spec)) == ("json_schema", WEATHER_TOOL["function"]["parameters"])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_required_choice_streams_its_calls(client, decode, tokenizer):
    script(decode, tokenizer, '[{"name": "get_time", "parameters": {"timezone": "UTC"}}, '
                              '{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "?"}],
                                                 tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", stream=True))
    schema = json.loads(decode.sampling[0].grammar.spec)
    assert schema["type"] == "array" and "maxItems" not in schema
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name) for d in deltas if d.id] == [(0, "get_time"), (1, "get_weather")]
    assert [d.function.arguments for d in deltas if not d.id] == ['{"timezone": "UTC"}', '{"city": "Oslo"}']
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_without_parallel_calls_allows_one(client, decode, tokenizer):
    script(decode, tokenizer, CALL_REPLY)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "?"}], tools=[WEATHER_TOOL],
                                   tool_choice="required", parallel_tool_calls=False)
    assert json.loads(decode.sampling[0].grammar.spec)["maxItems"] == 1


def test_forced_choice_and_response_format_together_are_400(client, decode):
    with pytest.raises(openai.BadRequestError, match="cannot be combined with response_format") as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL],
                                       tool_choice="required", response_format={"type": "json_object"})
    assert info.value.body["param"] == "tool_choice" and not decode.prompts


def test_parallel_tool_calls_false_keeps_the_first_call(client, decode, tokenizer):
    script(decode, tokenizer, CALL_REPLY)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Paris?"}],
                                         tools=[WEATHER_TOOL, TIME_TOOL], parallel_tool_calls=False)
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("kwargs,param,message", [
    ({"tool_choice": "required"}, "tool_choice", 'tool_choice "required" needs tools'),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "function 'nope', which is not in tools"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "two tools are named 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name",
     "tools.0.function.name: String should have at least 1 character"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice", "tool_choice: Input should be"),
])
def test_bad_tool_requests_are_400(client, decode, kwargs, param, message):
    with pytest.raises(openai.BadRequestError, match=re.escape(message)) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **kwargs)
    assert info.value.body["param"] == param and not decode.prompts


def test_the_router_reads_its_parser_from_the_chat_template(cluster):
    router, _ = cluster
    assert (router.config.tool_call_parser, router.config.enable_auto_tool_choice) == ("", True)
    # SmolLM2's template renders no tools: the router describes them in hermes' format and reads that.
    assert router.frontend.tool_format.parser_name == "hermes"


@pytest.mark.parametrize("parser,reply", [
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"timezone": "UTC"}}]'),
    ("pythonic", 'Checking.\n[get_weather(city="Paris"), get_time(timezone="UTC")]'),
    ("qwen3_coder", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=timezone>\nUTC\n"
                    "</parameter>\n</function>\n</tool_call>"),
    ("llama3_json", 'Checking.\n{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"timezone": "UTC"}}'),
])
def test_each_format_through_the_router_streamed_and_not(loop_thread, tokenizer, parser, reply):
    with scripted_router(loop_thread, tokenizer, tool_call_parser=parser) as (router, decode):
        client = openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="unused", max_retries=0)
        script(decode, tokenizer, reply, reply)
        messages = [{"role": "user", "content": "Weather and time in Paris?"}]
        full = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL])
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                     tools=[WEATHER_TOOL, TIME_TOOL], stream=True))
        # The template renders no tools: they were described in this parser's format.
        prompt = tokenizer.decode(decode.prompts[0], skip_special_tokens=False)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC"})]
    assert choice.message.content == ("Checking." if reply.startswith("Checking") else None)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name) for d in deltas if d.id] == [(0, "get_weather"), (1, "get_time")]
    assert [d.function.arguments for d in deltas if not d.id] == [c.function.arguments
                                                                  for c in choice.message.tool_calls]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (choice.message.content or "")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    marker = {"mistral": "[TOOL_CALLS]", "pythonic": "[func_name1(", "qwen3_coder": "<function=function_name>",
              "llama3_json": '"parameters"'}[parser]
    assert marker in prompt


def test_auto_off_or_no_parser_known_is_a_clear_400(loop_thread, tokenizer):
    with scripted_router(loop_thread, tokenizer, enable_auto_tool_choice=False) as (router, decode):
        client = openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--no-enable-auto-tool-choice") as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           tools=[WEATHER_TOOL])
        assert info.value.body["param"] == "tool_choice" and not decode.prompts
    # A template that renders tools in a format no parser knows: "auto" names the flag to pass.
    unknown = Tokenizer(tokenizer.backend, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=min(tokenizer.eos_token_ids),
                        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | tojson }}")
    with scripted_router(loop_thread, unknown) as (router, decode):
        client = openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match=re.escape("start the router with --tool-call-parser "
                                                                   "{hermes,llama3_json,mistral,pythonic,")):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           tools=[WEATHER_TOOL])
        script(decode, tokenizer, '{"city": "Paris"}')   # a named function needs no parser
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             tools=[WEATHER_TOOL],
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert out.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
