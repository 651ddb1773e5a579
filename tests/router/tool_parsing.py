"""Reading a tool-call parser's result in tests: the calls it found as (name, arguments), and a
parse of text fed in streamed chunks cut at given offsets (test_tool_calls.py, test_tool_formats.py)."""
from __future__ import annotations

import json

from router.tool_calls import Parsed


def calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def streamed(parser_cls, text: str, cuts: list[int]) -> Parsed:
    parser, out, start = parser_cls(), Parsed(), 0
    for cut in sorted(cuts) + [len(text)]:
        out.extend(parser.feed(text[start:cut]))
        start = cut
    out.extend(parser.finish())
    return out
