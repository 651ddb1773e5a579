"""The ``pythonic`` tool-call parser (router process): Llama 3.2 and Llama 4 (with their pythonic
templates), ToolACE and other models that answer with a Python list of calls:
``[get_weather(city="Paris", unit="celsius"), get_time(timezone='UTC')]``.

A list of calls starts a line (after optional text on earlier lines), as in llama3_json (the two
share ``router.tool_calls.LineStartParser``), so a list quoted inside a sentence stays content;
Llama 4's ``<|python_start|>`` / ``<|python_end|>`` are special tokens, already gone from the
router's text. The list is found by a scanner that knows Python's brackets and quoted strings,
then read with ``ast``: each element must be a call of a plain (or dotted) name with keyword
arguments only, each a literal (strings, numbers, True/False/None, lists, dicts, tuples), which
become the JSON arguments object. Anything else (positional arguments, a variable,
``float('inf')``, bad syntax, nesting deeper than ``MAX_JSON_DEPTH``) is content verbatim,
streaming or not, and the result is the same for any
split of the text into chunks.
"""
from __future__ import annotations

import ast
import json
import math

from router.json_limits import MAX_JSON_DEPTH, json_depth
from router.tool_calls import LineStartParser, ToolCall

MAX_CALL_LIST_CHARS = 1 << 20   # a longer list is not read as calls (ast on it would hold the loop)


class PythonScanner:
    """Where a Python list that starts at the first character fed ends: bracket depth outside
    quoted strings (single or double quotes, backslash escapes). Too deep or too long: ``failed``."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""
        self.escaped = False
        self.num_chars = 0
        self.failed = False

    def feed(self, char: str) -> bool:
        """True when ``char`` closes the list."""
        self.num_chars += 1
        if self.num_chars > MAX_CALL_LIST_CHARS:
            self.failed = True
            return True
        if self.quote:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == self.quote:
                self.quote = ""
            return False
        if char in "'\"":
            self.quote = char
        elif char in "([{":
            self.depth += 1
            if self.depth > MAX_JSON_DEPTH:
                self.failed = True
                return True
        elif char in ")]}":
            self.depth -= 1
            return self.depth == 0
        return False


def _callee(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _callee(node.value)
        return f"{owner}.{node.attr}" if owner else None
    return None


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(map(_finite, value))
    if isinstance(value, dict):
        return all(isinstance(k, str) and _finite(v) for k, v in value.items())
    return isinstance(value, (str, int, bool)) or value is None


def parse_call_list(text: str) -> list[ToolCall] | None:
    """``[f(a=1), g(b="x")]`` as ToolCalls; None if it is not such a list."""
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _callee(node.func)
        if name is None:
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:   # **kwargs
                return None
            try:
                value = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
            if isinstance(value, (set, bytes, complex)) or not _finite(value):
                return None
            arguments[keyword.arg] = list(value) if isinstance(value, tuple) else value
        if json_depth(arguments) > MAX_JSON_DEPTH:
            return None
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


class PythonicParser(LineStartParser):
    OPENERS = "["

    def new_scanner(self) -> PythonScanner:
        return PythonScanner()

    def read_calls(self, value: str) -> list[ToolCall] | None:
        return parse_call_list(value)
