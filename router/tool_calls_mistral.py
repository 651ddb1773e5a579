"""The ``mistral`` tool-call parser (router process): Mistral, Mixtral, Ministral, Devstral,
Magistral and Mistral Small write calls after a ``[TOOL_CALLS]`` control token, in one of two
shapes:

- tokenizer v3 to v7 (Mistral-7B-Instruct-v0.3, Mixtral-8x22B, Mistral Small 3.1): a JSON list
  (or one object) of ``{"name": ..., "arguments": {...}}``: ``[TOOL_CALLS][{"name": "f", ...}]``;
- tokenizer v11 and later (Mistral Small 3.2, Magistral, Devstral): one ``[TOOL_CALLS]`` per
  call, the bare name, then ``[ARGS]`` and the arguments object:
  ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}``; a ``[CALL_ID]id`` between the name and
  ``[ARGS]`` is read and dropped (the router names calls itself).

The control tokens are special tokens that detokenizing would drop; the router keeps them in the
text of a request this parser reads (``ToolFormat.marker_token_ids``, router/tool_formats.py).
The rules are those of router/tool_calls.py: a call is released when its JSON closes, one that
is not a call (bad JSON, a name with other characters, no ``[ARGS]``) is content verbatim, and
the result is the same for any split of the text into chunks (the parser reads one character at
a time and decides only on characters it has seen).
"""
from __future__ import annotations

import json
import re

from router.json_limits import loads_bounded
from router.tool_calls import (
    WHITESPACE,
    JsonValueScanner,
    Parsed,
    ToolCall,
    ToolCallParser,
    calls_from_json,
    partial_suffix,
)

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
MAX_NAME_CHARS = 64   # tool names are at most this long (router/tool_choice.py); longer is no call


class MistralParser(ToolCallParser):
    MARKER = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"
    MARKER_TOKENS = (MARKER, ARGS, CALL_ID)

    def __init__(self) -> None:
        self._pending = ""        # content not yet released: trailing whitespace or part of a marker
        self._after_call = False  # whitespace right after a call is dropped
        self._num_calls = 0
        self._state = "text"      # text | start | json | name | call_id | before_args | args
        self._raw = ""            # everything since the marker, verbatim: content again if no call
        self._held_ws = ""        # whitespace before the marker: dropped if a call follows
        self._name = ""
        self._tag = ""            # a control token being read after the name ("[ARGS]", "[CALL_ID]")
        self._json_start = 0      # where in _raw the JSON value began
        self._scanner: JsonValueScanner | None = None

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        for char in text:
            self._char(char, out)
        if self._state == "text":
            self._release(out)
        return out

    def _release(self, out: Parsed) -> None:
        keep = partial_suffix(self._pending, self.MARKER)
        head = self._pending[:len(self._pending) - keep]
        released = head.rstrip(WHITESPACE)   # trailing whitespace may precede a call
        out.content += released
        self._pending = self._pending[len(released):]

    def _char(self, char: str, out: Parsed) -> None:
        state = self._state
        if state == "text":
            if self._after_call:
                if char in WHITESPACE:
                    return
                self._after_call = False
            self._pending += char
            if self._pending.endswith(self.MARKER):
                before = self._pending[:-len(self.MARKER)]
                released = before.rstrip(WHITESPACE)
                out.content += released
                self._held_ws, self._pending = before[len(released):], ""
                self._raw, self._state = self.MARKER, "start"
            return
        self._raw += char
        if state == "start":
            if char in WHITESPACE:
                return
            if char in "[{":
                self._begin_json("json", char)
            elif char in _NAME_CHARS:
                self._name, self._tag, self._state = char, "", "name"
            else:
                self._fail(out, char)
        elif state in ("json", "args"):
            assert self._scanner is not None
            if self._scanner.feed(char):
                self._close(out)
        elif state in ("name", "call_id"):
            self._read_name(char, out)
        elif state == "before_args":
            if char == "{":
                self._begin_json("args", char)
            elif char not in WHITESPACE:
                self._fail(out, char)

    def _begin_json(self, state: str, char: str) -> None:
        self._scanner, self._json_start, self._state = JsonValueScanner(), len(self._raw) - 1, state
        self._scanner.feed(char)

    def _read_name(self, char: str, out: Parsed) -> None:
        """The name (or call id) up to ``[ARGS]`` (a call id after the name: ``[CALL_ID]``)."""
        if self._tag or char == "[":
            self._tag += char
            if self._tag == self.ARGS:
                if self._state == "name" and not _NAME.fullmatch(self._name):
                    self._fail(out, "")
                    return
                self._tag, self._state = "", "before_args"
            elif self._tag == self.CALL_ID and self._state == "name":
                self._tag, self._state = "", "call_id"
            elif not (self.ARGS.startswith(self._tag) or self._state == "name" and self.CALL_ID.startswith(self._tag)):
                self._fail(out, self._tag)
            return
        if char not in _NAME_CHARS or len(self._name) >= MAX_NAME_CHARS:
            self._fail(out, char)
        elif self._state == "name":
            self._name += char

    def _close(self, out: Parsed) -> None:
        value = loads_bounded(self._raw[self._json_start:])
        if self._state == "json":
            calls = calls_from_json(value)
        else:
            calls = [ToolCall(self._name, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else None
        if calls is None:
            self._fail(out, "")
            return
        out.tool_calls += calls
        self._num_calls += len(calls)
        self._reset()
        self._after_call = True

    def _fail(self, out: Parsed, refeed: str) -> None:
        """Not a call: the text since the marker is content; ``refeed``, the characters that
        showed it, are read again as text (they may begin the next marker)."""
        out.content += self._held_ws + self._raw[:len(self._raw) - len(refeed)]
        self._reset()
        for char in refeed:
            self._char(char, out)

    def _reset(self) -> None:
        self._state, self._raw, self._held_ws, self._name, self._tag, self._scanner = "text", "", "", "", "", None
        self._after_call = False

    def finish(self) -> Parsed:
        out = Parsed()
        if self._state != "text":   # cut off inside a call: it was never one
            out.content += self._held_ws + self._raw
            self._reset()
        pending, self._pending = self._pending, ""
        if not (self._num_calls and not pending.strip(WHITESPACE)):
            out.content += pending
        return out
