"""The ``qwen3_coder`` tool-call parser (router process): Qwen3-Coder writes each call as XML
inside hermes' tags, one parameter per element, values as raw text::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The tags are found as in hermes (``HermesParser``: content before a call streams, a call is
released at its close tag or at the end of the output, one that does not read is content
verbatim). A value is the text between its tags less one leading and one trailing newline; it is
converted by the type its tool's JSON schema gives the parameter (a ``string`` stays text;
``integer``, ``number``, ``boolean``, ``object``, ``array`` are read as JSON), and with no
schema type it is read as JSON when it is JSON, else kept as text.
"""
from __future__ import annotations

import json
import re

from router.json_limits import loads_bounded
from router.tool_calls import WHITESPACE, HermesParser, ToolCall

_FUNCTION = re.compile(r"<function=([^>\s]{1,64})>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]{1,256})>(.*?)</parameter>", re.DOTALL)
_JSON_TYPES = frozenset(("integer", "number", "boolean", "object", "array", "null"))


def _first_type(schema_type: object) -> object:
    """A JSON schema's ``type``, the first one where it lists several."""
    return schema_type[0] if isinstance(schema_type, list) and schema_type else schema_type


def _value(text: str, schema_type) -> object:
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    if schema_type == "string":
        return text
    value = loads_bounded(text)
    if value is None and text.strip() != "null":
        return text
    if isinstance(value, float) and value != value:   # NaN would not write back as JSON
        return text
    return value


class Qwen3CoderParser(HermesParser):
    def __init__(self, tools: tuple[dict, ...] = ()) -> None:
        super().__init__()
        # name -> parameter -> JSON schema type (the first, where a list of types is given)
        self._types: dict[str, dict[str, object]] = {}
        for tool in tools:
            function = tool.get("function", {})
            properties = (function.get("parameters") or {}).get("properties") or {}
            self._types[function.get("name", "")] = {
                p: _first_type(s.get("type")) for p, s in properties.items() if isinstance(s, dict)}

    @classmethod
    def for_tools(cls, tools: tuple[dict, ...]) -> Qwen3CoderParser:
        return cls(tools)

    def _read_body(self, body: str) -> list[ToolCall] | None:
        calls, end = [], 0
        for match in _FUNCTION.finditer(body):
            if body[end:match.start()].strip(WHITESPACE):
                return None
            end = match.end()
            name, inner = match.group(1), match.group(2)
            types = self._types.get(name, {})
            arguments, inner_end = {}, 0
            for parameter in _PARAMETER.finditer(inner):
                if inner[inner_end:parameter.start()].strip(WHITESPACE):
                    return None
                inner_end = parameter.end()
                key = parameter.group(1)
                arguments[key] = _value(parameter.group(2), types.get(key))
            if inner[inner_end:].strip(WHITESPACE):
                return None
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        if not calls or body[end:].strip(WHITESPACE):
            return None
        return calls
