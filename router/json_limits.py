"""Client JSON within bounds: how deep it nests, measured without recursion (router process).

A request body, a tool's schema or a tool call's ``arguments`` may nest as deep as a client
likes. ``json.loads`` itself stops near the interpreter's recursion limit (RecursionError), but a
value just under it still overflows whatever recurses over it later (``json.dumps``, pydantic, the
chat template's ``tojson``, the grammar compiler), and a recursive walk of our own would too. So a
value nested deeper than ``MAX_JSON_DEPTH`` is refused (a request body: router/openai_types.py;
tools: router/tool_choice.py) or, for text that is only read (a tool call's ``arguments``),
treated as not JSON; the walks that measure it keep their own stack. Real schemas and tool calls
nest a few levels, far from it.
"""
from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 128   # arrays and objects inside each other


def json_depth(value: Any) -> int:
    """How many arrays / objects deep ``value`` nests (a scalar is 0, ``{}`` is 1)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def loads_bounded(text: Any, default: Any = None) -> Any:
    """``json.loads(text)``, or ``default`` when ``text`` is not a string, not JSON, or nested
    more than ``MAX_JSON_DEPTH`` deep."""
    if not isinstance(text, str):
        return default
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return default
    return value if json_depth(value) <= MAX_JSON_DEPTH else default
