"""Tool-call parsers (router/tool_calls.py) on recorded outputs of each model family: the calls
and content they find, malformed calls kept as content, and the same result for any split of
the text into streamed chunks."""
from __future__ import annotations

import random

import pytest

from router.tool_calls import ForcedParser, HermesParser, Llama3JsonParser
from tests.router.tool_parsing import calls, streamed

QWEN_TWO_CALLS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", '
    '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": '
    '{"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"}}\n</tool_call>')
QWEN_TEXT_BEFORE = ('Let me look that up for you.\n\n<tool_call>\n{"name": "search_flights", "arguments": '
                    '{"origin": "LHR", "destination": "JFK", "passengers": 2}}\n</tool_call>')
HERMES_PRO = ('<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>')
HERMES_SINGLE_QUOTES = "<tool_call>\n{'arguments': {'symbol': 'TSLA'}, 'name': 'get_stock_fundamentals'}\n</tool_call>"
HERMES_UNCLOSED_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
SMOLLM2_LIST = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]</tool_call>')
LLAMA32_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA31_TWO_CALLS = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                     '{"name": "get_weather", "parameters": {"city": "Lyon"}}')
LLAMA_TEXT_BEFORE = ('I will check the weather in Paris.\n\n'
                     '{"name": "get_weather", "parameters": {"city": "Paris"}}')
LLAMA_PLAIN = 'The JSON {"name": "Bob", "age": 3} describes a person.\n{"name": "Bob", "age": 3}\nDone.'
LLAMA_BROKEN = '{"name": "get_weather", "parameters": {"city": "Paris"}'


def test_qwen_two_calls():
    out = HermesParser().parse(QWEN_TWO_CALLS)
    assert out.content == ""
    assert calls(out) == [
        ("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"})]
    assert out.tool_calls[0].arguments == '{"location": "San Francisco, CA, USA", "unit": "celsius"}'
    assert len({c.id for c in out.tool_calls}) == 2 and out.tool_calls[0].id.startswith("call_")


def test_hermes_text_before_the_call_is_content():
    out = HermesParser().parse(QWEN_TEXT_BEFORE)
    assert out.content == "Let me look that up for you."
    assert calls(out) == [("search_flights", {"origin": "LHR", "destination": "JFK", "passengers": 2})]


def test_hermes_2_pro_key_order_and_smollm2_list():
    assert calls(HermesParser().parse(HERMES_PRO)) == [("get_stock_fundamentals", {"symbol": "TSLA"})]
    assert calls(HermesParser().parse(SMOLLM2_LIST)) == [("get_weather", {"city": "Paris"}),
                                                         ("get_time", {"timezone": "Europe/Paris"})]


@pytest.mark.parametrize("text", [HERMES_SINGLE_QUOTES, HERMES_UNCLOSED_JSON,
                                  'Sure: <tool_call>{"arguments": {}}</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": {}, "extra": 1}</tool_call>',
                                  "I can't call <tool_c", "no tools here\n\n"])
def test_hermes_malformed_or_absent_call_is_the_text_verbatim(text):
    out = HermesParser().parse(text)
    assert (out.content, out.tool_calls) == (text, [])


def test_hermes_one_good_call_one_bad():
    text = QWEN_TEXT_BEFORE + "\n" + HERMES_SINGLE_QUOTES
    out = HermesParser().parse(text)
    assert calls(out) == [("search_flights", {"origin": "LHR", "destination": "JFK", "passengers": 2})]
    assert out.content == "Let me look that up for you." + HERMES_SINGLE_QUOTES


def test_hermes_call_ended_by_eos_without_close_tag():
    out = HermesParser().parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n')
    assert (out.content, calls(out)) == ("", [("get_weather", {"city": "Oslo"})])


def test_hermes_arguments_as_a_json_string():
    out = HermesParser().parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls(out) == [("f", {"x": 1})] and out.tool_calls[0].arguments == '{"x": 1}'


def test_llama3_single_and_two_calls():
    out = Llama3JsonParser().parse(LLAMA32_CALL)
    assert (out.content, calls(out)) == ("", [("get_weather", {"city": "Paris", "unit": "celsius"})])
    out = Llama3JsonParser().parse(LLAMA31_TWO_CALLS)
    assert (out.content, calls(out)) == ("", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})])


def test_llama3_text_before_and_json_inside_prose():
    out = Llama3JsonParser().parse(LLAMA_TEXT_BEFORE)
    assert (out.content, calls(out)) == ("I will check the weather in Paris.", [("get_weather", {"city": "Paris"})])
    # Objects that are not calls (no parameters), mid-sentence or on their own line, stay content.
    out = Llama3JsonParser().parse(LLAMA_PLAIN)
    assert (out.content, out.tool_calls) == (LLAMA_PLAIN, [])


def test_llama3_broken_or_cut_off_json_is_content():
    for text in (LLAMA_BROKEN, '{"name": "f", "parameters": {"a": 1,,}}', "  [1, 2]\nok"):
        out = Llama3JsonParser().parse(text)
        assert (out.content, out.tool_calls) == (text, [])


def test_llama3_text_after_calls_is_content():
    out = Llama3JsonParser().parse(LLAMA32_CALL + "\n\nI hope this helps.")
    assert (out.content, calls(out)) == ("I hope this helps.", [("get_weather", {"city": "Paris", "unit": "celsius"})])


RECORDED = [(HermesParser, t) for t in (QWEN_TWO_CALLS, QWEN_TEXT_BEFORE, HERMES_PRO, HERMES_SINGLE_QUOTES,
                                        HERMES_UNCLOSED_JSON, SMOLLM2_LIST, QWEN_TEXT_BEFORE + "\n" + HERMES_PRO,
                                        "no tools here\n\n<tool")] + \
           [(Llama3JsonParser, t) for t in (LLAMA32_CALL, LLAMA31_TWO_CALLS, LLAMA_TEXT_BEFORE, LLAMA_PLAIN,
                                            LLAMA_BROKEN, LLAMA32_CALL + "\n\nI hope this helps.")]


@pytest.mark.parametrize("parser_cls,text", RECORDED)
def test_streaming_in_any_chunks_equals_whole(parser_cls, text):
    whole = parser_cls().parse(text)
    expected = (whole.content, calls(whole))
    for cut in range(len(text) + 1):                 # every two-chunk split
        out = streamed(parser_cls, text, [cut])
        assert (out.content, calls(out)) == expected, cut
    rng = random.Random(0)
    for _ in range(50):                              # many small chunks, like tokens
        cuts = rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40)))
        out = streamed(parser_cls, text, cuts)
        assert (out.content, calls(out)) == expected, cuts
    one_char = streamed(parser_cls, text, list(range(1, len(text))))
    assert (one_char.content, calls(one_char)) == expected


def test_content_before_a_call_streams_before_the_call_ends():
    parser = HermesParser()
    first = parser.feed("Let me check. <tool_")
    assert first.content == "Let me check." and not first.tool_calls
    second = parser.feed('call>{"name": "f", "arguments": {"a": 1}}')
    assert second.content == "" and not second.tool_calls        # held until the call is complete
    third = parser.feed("</tool_call>")
    assert [c.name for c in third.tool_calls] == ["f"]
    assert parser.finish().content == ""


def test_forced_named_and_required():
    out = ForcedParser("get_weather").parse('{"city": "Paris"}')
    assert (out.content, calls(out)) == ("", [("get_weather", {"city": "Paris"})])
    out = ForcedParser(None).parse('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]')
    assert calls(out) == [("a", {"x": 1}), ("b", {})]
    # Cut off by max_tokens: what came out stays content.
    out = ForcedParser("get_weather").parse('{"city": "Par')
    assert (out.content, out.tool_calls) == ('{"city": "Par', [])
