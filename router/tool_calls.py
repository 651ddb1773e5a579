"""Tool-call parsers: a model's chat output -> content plus OpenAI ``tool_calls`` (router process).

One parser per output format, chosen by ``--tool-call-parser`` or from the model's chat template
(router/tool_formats.py, which lists them all; mistral, pythonic and qwen3_coder have files of
their own). Here:

- ``hermes``: Hermes 2 Pro, Qwen 2/2.5/3 and SmolLM2 write each call as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; SmolLM2 puts a JSON list of such
  objects between one pair of tags, which is accepted too.
- ``llama3_json``: Llama 3.1-3.3 write a bare ``{"name": ..., "parameters": {...}}`` object
  (``<|python_tag|>`` before it is a special token, already gone from the router's text). A
  call must start a line (after optional text on earlier lines) or follow another call
  separated by ``;``, ``,`` or whitespace, so JSON quoted inside a sentence stays content.
- ``ForcedParser`` is not a model format: under ``tool_choice`` ``required`` or a named function
  the output is constrained to JSON (router/tool_choice.py builds the schema), which it reads.

Every parser is incremental: ``feed(text)`` returns the content that is now certain and the
calls completed so far, ``finish()`` the rest. A call is released only once its JSON is complete
and valid, so a malformed call (bad JSON, not an object with a string ``name``, arguments that
are not an object) turns back into plain content, verbatim, in streaming as in non-streaming
responses; and the result is the same for any split of the text into chunks. JSON nested deeper
than ``router.json_limits.MAX_JSON_DEPTH`` counts as malformed. Whitespace between
content and a call is dropped; without calls the content is the model's text unchanged.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from router.json_limits import loads_bounded

WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                               # JSON text of an object, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    """What one ``feed`` / ``finish`` released."""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls


def calls_from_json(value, require_arguments: bool = False) -> list[ToolCall] | None:
    """A decoded call object, or a list of them, as ToolCalls; None if any is not a call: an
    object with a non-empty string ``name`` and ``arguments`` (or ``parameters``) that is an object
    or a JSON string holding one, and nothing else. Missing arguments are {} unless
    ``require_arguments`` (a bare JSON object in the text is a call only if it looks like one)."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        if set(item) - {"name", "arguments", "parameters"} or (require_arguments and len(item) != 2):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = loads_bounded(arguments)
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def _decode(text: str):
    """The JSON value of ``text``; None if it is not JSON or nests too deep to write back out."""
    return loads_bounded(text)


class JsonValueScanner:
    """Finds where a JSON object or array that starts at the first character fed ends, one
    character at a time: tracks nesting depth and whether it is inside a string. It does not
    validate; json.loads does that once the value is complete."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.failed = False   # never: json.loads bounds the value once it is complete

    def feed(self, char: str) -> bool:
        """True when ``char`` closes the value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
            return False
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """The interface: one instance per generated choice."""

    @classmethod
    def for_tools(cls, tools: tuple[dict, ...]) -> ToolCallParser:
        """A parser for a request with these tools (a format whose text has no types reads them)."""
        return cls()

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        """The whole output at once (non-streaming responses)."""
        parsed = self.feed(text)
        parsed.extend(self.finish())
        return parsed


class HermesParser(ToolCallParser):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._pending = ""        # text not yet released
        self._inside = False      # _pending is the body of an open <tool_call>
        self._held_ws = ""        # whitespace before the open tag: dropped if the call is valid
        self._after_call = False  # whitespace right after a call is dropped
        self._num_calls = 0

    def feed(self, text: str) -> Parsed:
        self._pending += text
        out = Parsed()
        while True:
            if self._inside:
                end = self._pending.find(self.CLOSE)
                if end < 0:
                    return out
                out.extend(self._close(self._pending[:end], self.CLOSE))
                self._pending = self._pending[end + len(self.CLOSE):]
                continue
            if self._after_call:
                self._pending = self._pending.lstrip(WHITESPACE)
                if not self._pending:
                    return out
                self._after_call = False
            start = self._pending.find(self.OPEN)
            if start < 0:
                keep = partial_suffix(self._pending, self.OPEN)
                head = self._pending[:len(self._pending) - keep]
                released = head.rstrip(WHITESPACE)   # trailing whitespace may precede a call
                out.content += released
                self._pending = self._pending[len(released):]
                return out
            before = self._pending[:start]
            released = before.rstrip(WHITESPACE)
            out.content += released
            self._held_ws = before[len(released):]
            self._pending = self._pending[start + len(self.OPEN):]
            self._inside = True

    def _close(self, body: str, close: str) -> Parsed:
        self._inside = False
        calls = self._read_body(body)
        if calls is None:
            return Parsed(self._held_ws + self.OPEN + body + close)
        self._held_ws = ""
        self._after_call = True
        self._num_calls += len(calls)
        return Parsed("", calls)

    def _read_body(self, body: str) -> list[ToolCall] | None:
        """The calls between one pair of tags; None if it holds none."""
        return calls_from_json(_decode(body.strip(WHITESPACE)))

    def finish(self) -> Parsed:
        pending, self._pending = self._pending, ""
        if self._inside:   # the output ended inside a call (EOS instead of the close tag, or max_tokens)
            return self._close(pending, "")
        if self._num_calls and not pending.strip(WHITESPACE):
            return Parsed()
        return Parsed(pending)


class Scanner(Protocol):
    failed: bool   # gave up (a limit reached): what it scanned is not calls

    def feed(self, char: str) -> bool:
        """True when ``char`` closes the value that began with the first character fed."""
        ...


class LineStartParser(ToolCallParser):
    """Calls written as a bare value that starts a line (llama3_json's JSON objects, pythonic's
    Python lists): the machinery both formats share.

    A value may open (one of ``OPENERS``) where the line holds only whitespace so far, or right
    after a call, with only whitespace and ``SEPARATORS`` between them; elsewhere the character is
    content, so a value quoted inside a sentence stays content. From the opener on, a scanner
    (``new_scanner``) finds where the value ends (or gives up: ``failed``), and ``read_calls`` turns
    the whole value into calls or refuses it, in which case it is content verbatim. Whitespace before the first call
    and whitespace or separators between calls are dropped, but only once the value turned out to
    be a call; text after the calls is content without the whitespace that led to it.
    """
    OPENERS = ""
    SEPARATORS = ""

    def __init__(self) -> None:
        self._pending = ""        # content not yet released: trailing whitespace, or separators after a call
        self._value = ""          # a candidate call being scanned
        self._scanner: Scanner | None = None
        self._line_blank = True   # only whitespace since the last newline: a call may start here
        self._after_call = False  # only whitespace and separators since the last call
        self._num_calls = 0

    def new_scanner(self) -> Scanner:
        raise NotImplementedError

    def read_calls(self, value: str) -> list[ToolCall] | None:
        """The calls the complete value ``value`` holds; None if it is not calls."""
        raise NotImplementedError

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        for char in text:
            if self._scanner is not None:
                self._value += char
                if self._scanner.feed(char):
                    out.extend(self._close())
                continue
            if char in self.OPENERS and (self._line_blank or self._after_call):
                if not self._after_call:   # whitespace before the first call is dropped only if it is one
                    released = self._pending.rstrip(WHITESPACE)
                    out.content += released
                    self._pending = self._pending[len(released):]
                self._scanner, self._value = self.new_scanner(), char
                self._scanner.feed(char)
                continue
            if self._after_call and (char in WHITESPACE or char in self.SEPARATORS):
                self._pending += char
                continue
            if self._after_call:   # text after the calls: content, without the whitespace that led to it
                self._pending = self._pending.lstrip(WHITESPACE)
                self._after_call = False
            self._pending += char
            self._line_blank = char == "\n" or (self._line_blank and char in WHITESPACE)
            if char not in WHITESPACE:
                out.content += self._pending
                self._pending = ""
        return out

    def _close(self) -> Parsed:
        value, scanner, self._value, self._scanner = self._value, self._scanner, "", None
        assert scanner is not None
        calls = None if scanner.failed else self.read_calls(value)
        if calls is None:
            pending = self._pending.lstrip(WHITESPACE) if self._after_call else self._pending
            self._after_call = False
            self._line_blank = False
            self._pending = ""
            return Parsed(pending + value)
        self._pending = ""          # whitespace before the first call, or separators between two
        self._after_call = True
        self._num_calls += len(calls)
        return Parsed("", calls)

    def finish(self) -> Parsed:
        if self._scanner is not None:   # cut off inside a value: it was never a call
            content = (self._pending.lstrip(WHITESPACE) if self._after_call else self._pending) + self._value
        elif self._after_call:
            content = ""
        else:
            content = self._pending
        self._pending, self._value, self._scanner = "", "", None
        return Parsed(content)


class Llama3JsonParser(LineStartParser):
    OPENERS = "{["
    SEPARATORS = ";,"

    def new_scanner(self) -> Scanner:
        return JsonValueScanner()

    def read_calls(self, value: str) -> list[ToolCall] | None:
        return calls_from_json(_decode(value), require_arguments=True)


class ForcedParser(ToolCallParser):
    """Output constrained to JSON by tool_choice (router/tool_choice.py): the arguments object of
    ``function_name``, or, with no name (``required``), a list of {"name", "parameters"} objects.
    Released at the end; output that does not decode (cut off by max_tokens) stays content."""

    def __init__(self, function_name: str | None) -> None:
        self._function_name = function_name
        self._text = ""

    def feed(self, text: str) -> Parsed:
        self._text += text
        return Parsed()

    def finish(self) -> Parsed:
        text, self._text = self._text, ""
        value = _decode(text)
        if self._function_name is not None and isinstance(value, dict):
            return Parsed("", [ToolCall(self._function_name, json.dumps(value, ensure_ascii=False))])
        calls = calls_from_json(value) if self._function_name is None and isinstance(value, list) else None
        return Parsed("", calls) if calls else Parsed(text)

