"""Tools on a chat request (router process): what ``tools``, ``tool_choice`` and
``parallel_tool_calls`` mean for the prompt, the sampling and the reading of the output.

- ``auto`` (OpenAI's default when tools are given): the template gets the tools and the
  router's parser (``--tool-call-parser``, else picked from the chat template:
  router/tool_formats.py) reads the output; a 400 naming the flag when no parser is known or
  the router runs with ``--no-enable-auto-tool-choice``.
- ``none``: neither: no tools in the template, the output is content.
- ``required`` / a named function: the output is forced to JSON by the structured-output
  machinery: the named function's arguments object, or a list of {"name", "parameters"}
  objects (one only without ``parallel_tool_calls``), and ``ForcedParser`` reads it. The
  template gets the tools too, so the model knows what it is calling.

A chat template that does not render ``tools`` (SmolLM2-135M-Instruct's) gets them described in
a system message instead, in the format the router's parser reads, and earlier turns' tool
calls and results are written as text in that format (``describe_tools``).

Bounds (400 naming ``tools``): at most ``MAX_TOOLS`` tools (OpenAI's 128), names of at most
``MAX_TOOL_NAME_CHARS``, each tool at most ``MAX_TOOL_CHARS`` of JSON and all together at most
``MAX_TOOLS_CHARS`` (what a forced call's schema may hold), nested at most ``MAX_JSON_DEPTH``
deep. Every check is linear in the size of the tools: this runs on the router's event loop.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.config import MAX_STRUCTURED_SPEC_CHARS
from router import errors
from router.json_limits import MAX_JSON_DEPTH, json_depth, loads_bounded
from router.tool_calls import ForcedParser, Parsed, ToolCallParser
from router.tool_formats import PARSERS, ToolFormat

CHOICES = ("auto", "none", "required")
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 64
MAX_TOOL_CHARS = 1 << 16                       # one tool as JSON text
MAX_TOOLS_CHARS = MAX_STRUCTURED_SPEC_CHARS    # all of them: a forced call's schema holds them all


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]        # OpenAI's [{"type": "function", "function": {name, description, parameters}}]
    choice: str                    # "auto", "required" or "function" (a named one)
    function_name: str | None      # the named function
    parallel: bool                 # more than one call per answer
    parser_name: str               # the router's parser ("" = none)

    @classmethod
    def from_openai(cls, tools: list[dict] | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None,
                    tool_format: ToolFormat) -> ToolRequest | None:
        """None when the request involves no tools; RouterError 400 for a choice that cannot hold."""
        tools = list(tools or [])
        check_tools(tools)
        names = {t["function"]["name"] for t in tools}
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            if name not in names:
                raise errors.invalid_request(f"tool_choice names function {name!r}, which is not in tools",
                                             "tool_choice")
            choice, function_name = "function", name
        else:
            choice, function_name = tool_choice or ("auto" if tools else "none"), None
        if choice not in CHOICES and choice != "function":
            raise errors.invalid_request(f"tool_choice must be one of {CHOICES} or a named function", "tool_choice")
        if choice == "required" and not tools:
            raise errors.invalid_request('tool_choice "required" needs tools', "tool_choice")
        if not tools or choice == "none":
            return None
        if choice == "auto" and (refusal := tool_format.auto_error()) is not None:
            raise errors.invalid_request(refusal, "tool_choice")
        return cls(tuple(tools), choice, function_name, parallel_tool_calls is not False, tool_format.parser_name)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def forced_schema(self) -> dict | None:
        """The JSON schema the output must follow under ``required`` or a named choice."""
        if self.choice == "function":
            assert self.function_name is not None   # set with the "function" choice
            return _parameters(self._function(self.function_name))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": _parameters(t["function"])},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def constrain(self, sampling) -> None:
        """Under ``required`` or a named choice, make ``sampling`` (a tandem.v1.Sampling) produce the
        forced call's JSON; 400 if the request constrains its output otherwise as well."""
        if not self.forced:
            return
        if sampling.HasField("structured_outputs"):
            named = self.choice if self.choice != 'function' else 'naming a function'
            raise errors.invalid_request(f"tool_choice {named}"
                                         " constrains the output; it cannot be combined with response_format or "
                                         "structured outputs", "tool_choice")
        sampling.structured_outputs.json_schema = json.dumps(self.forced_schema())

    def parser(self) -> ToolCallParser:
        """A fresh parser for one choice of the answer."""
        if self.forced:
            return ForcedParser(self.function_name)
        parser = PARSERS[self.parser_name].for_tools(self.tools)
        return parser if self.parallel else _FirstCallOnly(parser)

    def _function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def check_tools(tools: list[dict]) -> None:
    """400 naming ``tools`` for too many tools, a name too long or given twice, a tool too large or
    nested too deep; O(size of the tools)."""
    if len(tools) > MAX_TOOLS:
        raise errors.invalid_request(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    seen: set[str] = set()
    total_chars = 0
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if not 0 < len(name) <= MAX_TOOL_NAME_CHARS:
            raise errors.invalid_request(f"tool names are 1 to {MAX_TOOL_NAME_CHARS} characters; tools[{i}]'s is "
                                         f"{len(name)}", "tools")
        if name in seen:
            raise errors.invalid_request(f"two tools are named {name!r}", "tools")
        seen.add(name)
        if json_depth(tool) > MAX_JSON_DEPTH:
            raise errors.invalid_request(f"tools[{i}] is nested more than {MAX_JSON_DEPTH} levels deep", "tools")
        num_chars = len(json.dumps(tool, ensure_ascii=False))
        if num_chars > MAX_TOOL_CHARS:
            raise errors.invalid_request(f"tools[{i}] is {num_chars} characters of JSON, more than {MAX_TOOL_CHARS}",
                                         "tools")
        total_chars += num_chars
        if total_chars > MAX_TOOLS_CHARS:
            raise errors.invalid_request(f"the tools are more than {MAX_TOOLS_CHARS} characters of JSON together",
                                         "tools")


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


class _FirstCallOnly(ToolCallParser):
    """``parallel_tool_calls: false`` under ``auto``: calls after the first are dropped."""

    def __init__(self, inner: ToolCallParser) -> None:
        self._inner = inner
        self._seen_call = False

    def _keep_first(self, parsed: Parsed) -> Parsed:
        if self._seen_call:
            parsed.tool_calls = []
        elif parsed.tool_calls:
            parsed.tool_calls, self._seen_call = parsed.tool_calls[:1], True
        return parsed

    def feed(self, text: str) -> Parsed:
        return self._keep_first(self._inner.feed(text))

    def finish(self) -> Parsed:
        return self._keep_first(self._inner.finish())


# -- templates that do not render tools ------------------------------------------------------

_HERMES_INSTRUCTIONS = (
    "You may call one or more functions to answer the user. Each available function is described by a JSON "
    "schema between <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with a JSON "
    'object {{"name": <function name>, "arguments": <arguments object>}} between <tool_call></tool_call> tags, '
    "one pair of tags per call. Function results come back between <tool_response></tool_response> tags.")
_LLAMA3_INSTRUCTIONS = (
    "You may call functions to answer the user. The available functions, one JSON schema per line:\n{tools}\n\n"
    'To call a function, answer with only a JSON object {{"name": <function name>, "parameters": <arguments '
    "object>}}; separate several calls with a semicolon. Function results come back between "
    "<tool_response></tool_response> tags.")


_MISTRAL_INSTRUCTIONS = (
    "You may call functions to answer the user. The available functions, one JSON schema per line:\n{tools}\n\n"
    'To call functions, answer with [TOOL_CALLS] followed by a JSON list of objects {{"name": <function name>, '
    '"arguments": <arguments object>}}, one per call. Function results come back between '
    "<tool_response></tool_response> tags.")
_PYTHONIC_INSTRUCTIONS = (
    "You may call functions to answer the user. The available functions, one JSON schema per line:\n{tools}\n\n"
    "To call functions, answer with only a Python list of calls with keyword arguments, "
    "[func_name1(param1=value1, param2=value2), func_name2(param=value)]. Function results come back between "
    "<tool_response></tool_response> tags.")
_QWEN3_CODER_INSTRUCTIONS = (
    "You may call one or more functions to answer the user. Each available function is described by a JSON "
    "schema between <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with\n"
    "<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue\n</parameter>\n</function>\n"
    "</tool_call>\none <tool_call> per call. Function results come back between <tool_response></tool_response> "
    "tags.")
_INSTRUCTIONS = {"hermes": _HERMES_INSTRUCTIONS, "llama3_json": _LLAMA3_INSTRUCTIONS,
                 "mistral": _MISTRAL_INSTRUCTIONS, "pythonic": _PYTHONIC_INSTRUCTIONS,
                 "qwen3_coder": _QWEN3_CODER_INSTRUCTIONS}


def _python_literal(value) -> str:
    """A JSON value as Python source (True, False, None where JSON says true, false, null)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_python_literal(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_python_literal, value)) + "]"
    return json.dumps(value, ensure_ascii=False)


def _calls_as_text(calls: list[dict], parser_name: str) -> str:
    """An assistant turn's tool calls written as the parser reads them."""
    named = []
    for call in calls:
        function = call.get("function", call)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            arguments = loads_bounded(arguments, default=arguments)   # not JSON, or too deep: written as text
        named.append((function.get("name"), arguments))
    if parser_name == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in named)
    if parser_name == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in named], ensure_ascii=False)
    if parser_name == "pythonic":
        return "[" + ", ".join(
            f"{n}(" + ", ".join(f"{k}={_python_literal(v)}" for k, v in a.items()) + ")" if isinstance(a, dict)
            else f"{n}({a!r})" for n, a in named) + "]"
    if parser_name == "qwen3_coder":
        return "\n".join(
            f"<tool_call>\n<function={n}>\n" + "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                for k, v in (a.items() if isinstance(a, dict) else ())) + "</function>\n</tool_call>"
            for n, a in named)
    return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
                     for n, a in named)


def describe_tools(messages: list[dict], tools: tuple[dict, ...] | None, parser_name: str) -> list[dict]:
    """``messages`` for a template without tool support: the tools described in the (first) system
    message, assistant tool calls written out as the parser reads them, tool results as user
    messages between <tool_response> tags."""
    out = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            content = message.get("content") or ""
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif role == "assistant" and message.get("tool_calls"):
            calls = _calls_as_text(message["tool_calls"], parser_name)
            content = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n\n{calls}" if content else calls})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        template = _INSTRUCTIONS.get(parser_name, _HERMES_INSTRUCTIONS)
        text = template.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def prompt_inputs(messages: list[dict], request: ToolRequest | None, template_takes_tools: bool,
                  parser_name: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template: the tools go to a template that renders them,
    else into a system message; a request without tools (or with ``none``) passes None."""
    tools = request.tools if request is not None else None
    if template_takes_tools:
        return _with_argument_objects(messages), list(tools) if tools else None
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if tools or has_tool_turns:
        return describe_tools(messages, tools, parser_name), None
    return messages, None


def _with_argument_objects(messages: list[dict]) -> list[dict]:
    """Messages for a template that renders tools: an assistant tool call's ``arguments`` JSON
    string becomes the object Hugging Face templates expect (``arguments | tojson``)."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call["function"])
                arguments = loads_bounded(function["arguments"])   # None: not JSON, or too deep
                if isinstance(arguments, dict):
                    function["arguments"] = arguments
                calls.append({**call, "function": function})
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


class AnswerReader:
    """One choice of an answer read through the request's parser: what is content, which tool
    calls were made, and the finish_reason (``tool_calls`` when the model stopped after calling)."""

    def __init__(self, request: ToolRequest) -> None:
        self._parser = request.parser()
        self.num_calls = 0

    def read(self, text: str, finish_reason: str | None) -> tuple[Parsed, str | None]:
        parsed = self._parser.feed(text)
        if finish_reason is not None:
            parsed.extend(self._parser.finish())
        self.num_calls += len(parsed.tool_calls)
        if finish_reason == "stop" and self.num_calls:
            finish_reason = "tool_calls"
        return parsed, finish_reason
