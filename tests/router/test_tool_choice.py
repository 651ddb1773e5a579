"""router/tool_choice.py: what tool_choice means for the request (the 400s), the JSON schema that
forces required and named calls, and the chat template inputs with and without a template that
renders tools (compared with transformers' apply_chat_template)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.tokenizer import Tokenizer
from router.errors import RouterError
from router.tool_calls import ForcedParser
from router.tool_choice import AnswerReader, ToolRequest, describe_tools, prompt_inputs
from router.tool_formats import ToolFormat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def request(tool_choice=None, tools=(WEATHER, CLOCK), parallel=None, parser="hermes", auto=True):
    return ToolRequest.from_openai(list(tools), tool_choice, parallel, ToolFormat(parser, "test", auto, frozenset()))


def test_choices_and_their_defaults():
    assert request().choice == "auto" and request(parallel=None).parallel
    assert request(tools=()) is None and request("none") is None and request("auto", tools=()) is None
    named = request({"type": "function", "function": {"name": "get_time"}})
    assert (named.choice, named.function_name, named.forced) == ("function", "get_time", True)
    assert request("required", parallel=False).parallel is False
    # Forced choices need no parser: the output is JSON by construction.
    required = request("required", parser="", auto=False)
    assert (required.forced, type(required.parser()).__name__) == (True, "ForcedParser")
    assert type(request().parser()).__name__ == "HermesParser"
    assert type(request(parser="llama3_json").parser()).__name__ == "Llama3JsonParser"


@pytest.mark.parametrize("kwargs,message", [
    ({"tool_choice": "required", "tools": ()}, 'tool_choice "required" needs tools'),
    ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "function 'x', which is not in tools"),
    ({"tools": (WEATHER, WEATHER)}, "two tools are named 'get_weather'"),
    ({"auto": False}, 'tool_choice "auto" is off on this router (--no-enable-auto-tool-choice)'),
    ({"parser": ""}, 'tool_choice "auto" needs a tool-call parser, and test: start the router with '
                     "--tool-call-parser {hermes,llama3_json,mistral,pythonic,qwen3_coder}"),
])
def test_requests_that_cannot_hold_are_400(kwargs, message):
    with pytest.raises(RouterError, match=re.escape(message)) as info:
        request(**kwargs)
    assert info.value.http_status == 400 and message in str(info.value)


def test_forced_schemas():
    named = request({"type": "function", "function": {"name": "get_weather"}})
    assert named.forced_schema() == WEATHER["function"]["parameters"]
    assert request({"type": "function", "function": {"name": "get_time"}}).forced_schema() == {
        "type": "object", "properties": {}}
    assert request("required", tools=(WEATHER,), parallel=False).forced_schema() == {
        "type": "array", "minItems": 1, "maxItems": 1,
        "items": {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                                                   "parameters": WEATHER["function"]["parameters"]},
                  "required": ["name", "parameters"], "additionalProperties": False}}
    schema = request("required").forced_schema()
    assert "maxItems" not in schema and [len(schema["items"]["anyOf"])] == [2]
    assert request().forced_schema() is None


def test_required_schema_accepts_what_forced_parser_reads():
    schema = request("required").forced_schema()
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError, match="Failed validating"):
            jsonschema.validate(bad, schema)
    parsed = ForcedParser(None).parse(json.dumps(good))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                                            ("get_time", {})]


def test_schemas_compile_with_xgrammar(tokenizer):
    xgrammar = pytest.importorskip("xgrammar")
    info = xgrammar.TokenizerInfo.from_huggingface(_hf(tokenizer), vocab_size=tokenizer.vocab_size)
    compiler = xgrammar.GrammarCompiler(info)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        compiler.compile_json_schema(json.dumps(request(choice).forced_schema()))


def _hf(tokenizer: Tokenizer):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)


def test_answer_reader_finish_reason_and_first_call_only():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    parsed, finish = AnswerReader(request()).read(text, "stop")
    assert finish == "tool_calls" and [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]
    parsed, finish = AnswerReader(request(parallel=False)).read(text, "stop")
    assert finish == "tool_calls" and [c.name for c in parsed.tool_calls] == ["get_weather"]
    parsed, finish = AnswerReader(request()).read(text[:40], "length")
    assert (finish, parsed.tool_calls, parsed.content) == ("length", [], text[:40])
    assert AnswerReader(request()).read("plain", "stop")[1] == "stop"


# A tool-aware template in the style of Qwen 2.5's, to compare with transformers.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
]


def test_tools_reach_a_tool_template_as_transformers_passes_them(tokenizer):
    tool_tokenizer = Tokenizer(tokenizer.backend, bos_token_id=None, eos_token_id=2, chat_template=TOOL_TEMPLATE)
    assert tool_tokenizer.template_takes_tools and not tokenizer.template_takes_tools
    messages, tools = prompt_inputs(CONVERSATION, request(), True, "hermes")
    assert tools == [WEATHER, CLOCK]
    # The arguments are an object, as HF templates expect.
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    ours = tool_tokenizer.apply_chat_template(messages, tools=tools)
    hf = _hf(tool_tokenizer)
    theirs = hf.apply_chat_template(messages, tools=tools, chat_template=TOOL_TEMPLATE, tokenize=False,
                                    add_generation_prompt=True)
    assert ours == theirs
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in ours
    assert json.dumps(CLOCK) in ours


def test_template_without_tools_gets_them_described(tokenizer):
    messages, tools = prompt_inputs([{"role": "system", "content": "Be brief."}] + CONVERSATION, request(),
                                    False, "hermes")
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\nYou may call")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(CLOCK) + "\n</tools>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                          '{"city": "Paris"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": '<tool_response>\n{"temperature": 18}\n</tool_response>'}
    text = tokenizer.apply_chat_template(messages)
    assert text.count("<|im_start|>") == 5 and text.endswith("<|im_start|>assistant\n")
    # llama3_json: calls as bare JSON with "parameters", ;-separated.
    llama = describe_tools(CONVERSATION[:2], (WEATHER,), "llama3_json")
    assert llama[2]["content"] == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert "one JSON schema per line" in llama[0]["content"]


def test_no_tools_but_tool_turns_are_still_written_as_text():
    messages, tools = prompt_inputs(CONVERSATION, None, False, "hermes")
    assert tools is None and messages[0] == CONVERSATION[0] and "<tool_call>" in messages[1]["content"]
    assert all(m["role"] != "system" for m in messages)
    assert prompt_inputs(CONVERSATION[:1], None, False, "") == (CONVERSATION[:1], None)


def test_router_flags():
    from router.__main__ import parse_args
    from router.config import RouterConfig
    config = parse_args(["--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"])
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("llama3_json", True)
    # Out of the box: the parser comes from the chat template and "auto" is on.
    config = parse_args([])
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("", True)
    assert parse_args(["--no-enable-auto-tool-choice"]).enable_auto_tool_choice is False
    assert parse_args(["--tool-call-parser", "mistral"]).tool_call_parser == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser='granite'"):
        RouterConfig(tool_call_parser="granite")
