"""The mistral, pythonic and qwen3_coder parsers on outputs in each family's format (as the
models' cards and chat templates write them), the same result for every split of the text into
streamed chunks, and the parser picked from a chat template (router/tool_formats.py)."""
from __future__ import annotations

import functools
import random

import pytest
import tokenizers
from tokenizers import AddedToken

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from router.config import TOOL_CALL_PARSERS
from router.tool_calls_mistral import MistralParser
from router.tool_calls_pythonic import PythonicParser
from router.tool_calls_xml import Qwen3CoderParser
from router.tool_formats import PARSERS, ToolFormat, detect
from tests.router.tool_parsing import calls, streamed

# Mistral-7B-Instruct-v0.3 / Mixtral-8x22B (tokenizer v3): one marker, a JSON list.
MISTRAL_V3 = ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"city": "Dallas", "state": "TX", '
              '"unit": "fahrenheit"}}, {"name": "get_current_weather", "arguments": {"city": "Orlando", '
              '"state": "FL", "unit": "fahrenheit"}}]')
# Mistral Small 3.1: no space after the marker, text before it.
MISTRAL_TEXT_BEFORE = ('Let me check the weather for you.[TOOL_CALLS][{"name": "get_weather", '
                       '"arguments": {"city": "Paris"}}]')
# Mistral Small 3.2 / Magistral / Devstral (tokenizer v11+): name[ARGS]{...} per marker.
MISTRAL_V11 = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
               '[TOOL_CALLS]get_time[ARGS]{"timezone": "Europe/Paris"}')
MISTRAL_CALL_ID = '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Oslo"}'
MISTRAL_BROKEN = [
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]',      # bad JSON
    "[TOOL_CALLS]get weather[ARGS]{}",                                            # a space in the name
    '[TOOL_CALLS]get_weather{"city": "Paris"}',                                   # no [ARGS]
    '[TOOL_CALLS]get_weather[ARGS]["Paris"]',                                     # arguments not an object
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',            # cut off by max_tokens
    "The [TOOL_ token is not a marker.",
]
# Llama 3.2 (pythonic template) / Llama 4 / ToolACE.
PYTHONIC_TWO = '[get_weather(city="San Francisco", metric="celsius"), get_time(timezone=\'America/Los_Angeles\')]'
PYTHONIC_TYPES = ('[register_user(name="John Doe", age=37, address={"city": "San Francisco", "state": "CA"}, '
                  'role=None, passed_test=True, aliases=["John", "Johnny"], scores=(1.5, -2))]')
PYTHONIC_TEXT_BEFORE = 'I will look up the weather.\n[get_weather(city="Paris")]'
PYTHONIC_BROKEN = [
    "The list [a(b=1)] is inside a sentence.",       # not at a line start
    '[get_weather("Paris")]',                        # positional argument
    "[get_weather(city=paris)]",                     # a variable, not a literal
    "[1, 2, 3]",                                     # not calls
    "[get_weather(city=float('inf'))]",              # a call as a value
    "[get_weather(n=1e999)]",                        # not finite
    '[get_weather(city="Par',                        # cut off
    "[f(x=" + "[" * 200 + "]" * 200 + ")]",          # nested too deep
]
QWEN3_CODER = ('I will check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n'
               '</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
               '<function=run_code>\n<parameter=code>\nprint("hi")\nprint(1 < 2)\n</parameter>\n'
               '<parameter=zip>\n02139\n</parameter>\n</function>\n</tool_call>')
QWEN3_CODER_BROKEN = [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",   # unclosed parameter
    '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',                      # hermes JSON
    "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>",
]
CODER_TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
                   "city": {"type": "string"}, "days": {"type": "integer"}}}}},
               {"type": "function", "function": {"name": "run_code", "parameters": {"type": "object", "properties": {
                   "code": {"type": "string"}, "zip": {"type": "string"}}}}})
Coder = functools.partial(Qwen3CoderParser, CODER_TOOLS)


def test_mistral_v3_list_and_text_before():
    out = MistralParser().parse(MISTRAL_V3)
    assert (out.content, calls(out)) == ("", [
        ("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}),
        ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"})])
    out = MistralParser().parse(MISTRAL_TEXT_BEFORE)
    assert (out.content, calls(out)) == ("Let me check the weather for you.", [("get_weather", {"city": "Paris"})])


def test_mistral_v11_name_args_and_call_id():
    out = MistralParser().parse(MISTRAL_V11)
    assert (out.content, calls(out)) == ("", [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                              ("get_time", {"timezone": "Europe/Paris"})])
    out = MistralParser().parse(MISTRAL_CALL_ID + "\n\nDone.")
    assert (out.content, calls(out)) == ("Done.", [("get_weather", {"city": "Oslo"})])


@pytest.mark.parametrize("text", MISTRAL_BROKEN)
def test_mistral_malformed_is_the_text_verbatim(text):
    out = MistralParser().parse(text)
    assert (out.content, out.tool_calls) == (text, [])


def test_mistral_a_bad_call_then_a_good_one():
    out = MistralParser().parse(MISTRAL_BROKEN[1] + MISTRAL_CALL_ID)
    assert (out.content, calls(out)) == (MISTRAL_BROKEN[1], [("get_weather", {"city": "Oslo"})])


def test_pythonic_calls_and_literal_types():
    out = PythonicParser().parse(PYTHONIC_TWO)
    assert (out.content, calls(out)) == ("", [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
                                              ("get_time", {"timezone": "America/Los_Angeles"})])
    out = PythonicParser().parse(PYTHONIC_TYPES)
    assert calls(out) == [("register_user", {"name": "John Doe", "age": 37,
                                             "address": {"city": "San Francisco", "state": "CA"}, "role": None,
                                             "passed_test": True, "aliases": ["John", "Johnny"], "scores": [1.5, -2]})]
    out = PythonicParser().parse(PYTHONIC_TEXT_BEFORE + "\nAnything else?")
    assert (out.content, calls(out)) == ("I will look up the weather.Anything else?",
                                         [("get_weather", {"city": "Paris"})])


@pytest.mark.parametrize("text", PYTHONIC_BROKEN)
def test_pythonic_malformed_is_the_text_verbatim(text):
    out = PythonicParser().parse(text)
    assert (out.content, out.tool_calls) == (text, [])


def test_qwen3_coder_values_typed_by_the_schema():
    out = Coder().parse(QWEN3_CODER)
    assert (out.content, calls(out)) == ("I will check both.", [
        ("get_weather", {"city": "San Francisco", "days": 3}),
        ("run_code", {"code": 'print("hi")\nprint(1 < 2)', "zip": "02139"})])
    # Without a schema, a value that is JSON is read as JSON (3), other text stays text (02139).
    assert calls(Qwen3CoderParser().parse(QWEN3_CODER)) == [
        ("get_weather", {"city": "San Francisco", "days": 3}),
        ("run_code", {"code": 'print("hi")\nprint(1 < 2)', "zip": "02139"})]
    untyped = Qwen3CoderParser().parse("<tool_call><function=f><parameter=n>\n007\n</parameter>"
                                       "<parameter=b>true</parameter></function></tool_call>")
    assert calls(untyped) == [("f", {"n": "007", "b": True})]


@pytest.mark.parametrize("text", QWEN3_CODER_BROKEN)
def test_qwen3_coder_malformed_is_the_text_verbatim(text):
    out = Coder().parse(text)
    assert (out.content, out.tool_calls) == (text, [])


RECORDED = ([(MistralParser, t) for t in [MISTRAL_V3, MISTRAL_TEXT_BEFORE, MISTRAL_V11, MISTRAL_CALL_ID + "\nOk",
                                          MISTRAL_BROKEN[1] + MISTRAL_CALL_ID, *MISTRAL_BROKEN]]
            + [(PythonicParser, t) for t in [PYTHONIC_TWO, PYTHONIC_TYPES, PYTHONIC_TEXT_BEFORE + "\n\nOk.",
                                             *PYTHONIC_BROKEN[:-1]]]
            + [(Coder, t) for t in [QWEN3_CODER, *QWEN3_CODER_BROKEN]])


@pytest.mark.parametrize("parser_cls,text", RECORDED)
def test_streaming_in_any_chunks_equals_whole(parser_cls, text):
    whole = parser_cls().parse(text)
    expected = (whole.content, calls(whole))
    for cut in range(len(text) + 1):                 # every two-chunk split
        out = streamed(parser_cls, text, [cut])
        assert (out.content, calls(out)) == expected, cut
    one_char = streamed(parser_cls, text, list(range(1, len(text))))
    assert (one_char.content, calls(one_char)) == expected
    rng = random.Random(0)
    for _ in range(20):                              # token-sized chunks
        cuts = rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40)))
        out = streamed(parser_cls, text, cuts)
        assert (out.content, calls(out)) == expected, cuts


def test_content_streams_before_the_call_is_complete():
    parser = MistralParser()
    assert parser.feed("Checking now. [TOOL_").content == "Checking now."
    assert parser.feed('CALLS]get_weather[ARGS]{"city": ').tool_calls == []
    assert [c.name for c in parser.feed('"Paris"}').tool_calls] == ["get_weather"]
    parser = PythonicParser()
    assert parser.feed("Sure.\n[get_we").content == "Sure."
    assert [c.name for c in parser.feed('ather(city="Paris")]').tool_calls] == ["get_weather"]


# -- the parser from the chat template ----------------------------------------------------------

QWEN3_TEMPLATE = ("{%- if tools %}{{- '<tools>' }}{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}"
                  "{{- '</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call>' }}"
                  "{%- endif %}")
QWEN3_CODER_TEMPLATE = QWEN3_TEMPLATE + "{{- '<tool_call>\\n<function=example_function_name>' }}"
MISTRAL_TEMPLATE = ("{%- if tools %}{{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
                    "{%- for m in messages %}{%- if m.tool_calls %}{{- '[TOOL_CALLS]' }}{%- endif %}{%- endfor %}")
LLAMA31_TEMPLATE = ("{%- if tools %}{{- 'Respond in the format {\"name\": function name, \"parameters\": "
                    "dictionary of argument name and its value}.' }}{%- endif %}{{- '<|python_tag|>' }}")
LLAMA32_TEMPLATE = ("{%- if tools %}{{- 'Respond in the format {\"name\": function name, \"parameters\": "
                    "dictionary of argument name and its value}. Do not use variables.' }}{%- endif %}")
PYTHONIC_TEMPLATE = ("{%- if tools %}{{- 'you MUST put it in the format of [func_name1(params_name1=params_value1, "
                     "params_name2=params_value2...), func_name2(params)]' }}{%- endif %}")
UNKNOWN_TEMPLATE = "{%- if tools %}{{- tools | tojson }}{%- endif %}{{- messages[0].content }}"


@pytest.mark.parametrize("template,takes_tools,name", [
    (QWEN3_TEMPLATE, True, "hermes"), (QWEN3_CODER_TEMPLATE, True, "qwen3_coder"),
    (MISTRAL_TEMPLATE, True, "mistral"), (LLAMA31_TEMPLATE, True, "llama3_json"),
    (LLAMA32_TEMPLATE, True, "llama3_json"), (PYTHONIC_TEMPLATE, True, "pythonic"),
    (UNKNOWN_TEMPLATE, True, ""), ("{{ messages[0].content }}", False, "hermes"), (None, False, "hermes")])
def test_detect_from_the_chat_template(template, takes_tools, name):
    assert detect(template, takes_tools)[0] == name


def test_config_lists_every_parser():
    assert tuple(PARSERS) == TOOL_CALL_PARSERS


def _tokenizer(template: str | None, special: bool = True) -> Tokenizer:
    vocab = {"[UNK]": 0, "get_weather": 1, "{}": 2, "Hi": 3, "</s>": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken("</s>", special=True)])
    add = backend.add_special_tokens if special else backend.add_tokens
    add([AddedToken(t, special=special, normalized=False) for t in ("[TOOL_CALLS]", "[ARGS]")])
    return Tokenizer(backend, bos_token_id=None, eos_token_id=4, chat_template=template)


def test_resolve_keeps_mistral_special_markers_in_the_text():
    tok = _tokenizer(MISTRAL_TEMPLATE)
    fmt = ToolFormat.resolve("", True, tok)
    marker_ids = {tok.token_to_id("[TOOL_CALLS]"), tok.token_to_id("[ARGS]")}
    assert (fmt.parser_name, fmt.marker_token_ids, fmt.auto_error()) == ("mistral", marker_ids, None)
    ids = tok.encode("Hi [TOOL_CALLS] get_weather [ARGS] {} </s>", add_special_tokens=False)
    assert tok.decode(ids) == "Hi get_weather {}"                    # skipped, as for any request
    detok = IncrementalDetokenizer(tok, keep_token_ids=fmt.marker_token_ids)
    text = "".join(detok.add([i]) for i in ids) + detok.finish()
    assert text == "Hi [TOOL_CALLS] get_weather [ARGS] {}"            # EOS still skipped
    assert calls(MistralParser().parse(text.replace(" ", ""))) == [("get_weather", {})]
    # Markers that are plain text need nothing kept; an explicit parser wins over the template.
    assert ToolFormat.resolve("", True, _tokenizer(MISTRAL_TEMPLATE, special=False)).marker_token_ids == frozenset()
    assert ToolFormat.resolve("hermes", True, tok).parser_name == "hermes"


def test_auto_refused_without_a_parser_or_when_turned_off():
    unknown = ToolFormat.resolve("", True, _tokenizer(UNKNOWN_TEMPLATE))
    assert unknown.parser_name == "" and "--tool-call-parser {hermes," in unknown.auto_error()
    assert "renders tools in no format the router knows" in unknown.auto_error()
    off = ToolFormat.resolve("", False, _tokenizer(QWEN3_TEMPLATE))
    assert off.parser_name == "hermes" and "--no-enable-auto-tool-choice" in off.auto_error()
