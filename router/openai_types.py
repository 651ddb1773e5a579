"""OpenAI / vLLM request bodies (pydantic) and their mapping onto tandem.v1.Sampling (router process).

Unknown fields are ignored, like OpenAI and vLLM do, as long as they are JSON nested at most
MAX_JSON_DEPTH deep (deeper is a 400 naming the field: every walk over it must stay bounded).
Ranges are checked in router.sampling, the one place both APIs share, so a bad value reads the
same over HTTP and gRPC; here only what must hold before a value can go into a protobuf field at
all (integer widths, the stop list's size) and what only HTTP has (n, seed + n).
``parse_body`` turns raw JSON bytes into one of these models, naming the field (``param``) of
the first thing wrong, text that is not valid Unicode included (a lone surrogate would fail
later inside protobuf or the tokenizer).
"""
from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable
from typing import Any, Literal, TypeVar, Union

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.config import DEFAULT_MAX_TOKENS
from protos.tandem.v1 import tandem_pb2
from router.errors import RouterError, clip, invalid_request
from router.json_limits import MAX_JSON_DEPTH
from router.sampling import check_stop, output_grammar, unencodable
from router.tool_choice import MAX_TOOLS

MAX_N = 16
_INT32 = range(-2**31, 2**31)
_INT64 = range(-2**63, 2**63)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = ""
    description: str | None = None
    schema_: Union[dict, bool, None] = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's structured_outputs: exactly one of these."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    json_: Union[dict, bool, str, None] = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def _schema_text(schema: Union[dict, bool, str]) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    request_id: str = ""
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Union[dict, bool, str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = None   # vLLM's: only requests with the same salt share prefix-cache blocks

    def structured(self) -> tandem_pb2.StructuredOutputs | None:
        """The one output constraint the body asks for (None: free text); 400 naming the field
        when it is malformed or when two are given."""
        found: list[tuple[str, tandem_pb2.StructuredOutputs]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", tandem_pb2.StructuredOutputs(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise invalid_request("response_format json_schema needs json_schema.schema",
                                      "response_format.json_schema")
            found.append(("response_format",
                          tandem_pb2.StructuredOutputs(json_schema=_schema_text(rf.json_schema.schema_))))
        so = self.structured_outputs
        if so is not None:
            given: dict[str, Any] = {"json_schema": None if so.json_ is None else _schema_text(so.json_),
                     "json_object": so.json_object or None, "regex": so.regex,
                     "choice": None if so.choice is None else tandem_pb2.Choices(values=so.choice),
                     "grammar": so.grammar}
            given = {k: v for k, v in given.items() if v is not None}
            if len(given) != 1:
                raise invalid_request("structured_outputs must set exactly one of json, json_object, regex, choice "
                                      f"and grammar, got {len(given)}", "structured_outputs")
            found.append(("structured_outputs", tandem_pb2.StructuredOutputs(**given)))
        guided: tuple[tuple[str, str, Any], ...] = (("guided_json", "json_schema", self.guided_json),
                                                     ("guided_regex", "regex", self.guided_regex),
                                                     ("guided_choice", "choice", self.guided_choice),
                                                     ("guided_grammar", "grammar", self.guided_grammar))
        for param, kind, value in guided:
            if value is not None:
                spec: Any = (_schema_text(value) if kind == "json_schema"
                             else tandem_pb2.Choices(values=value) if kind == "choice" else value)
                found.append((param, tandem_pb2.StructuredOutputs(**{kind: spec})))
        if not found:
            return None
        if len(found) > 1:
            raise invalid_request(f"give one output constraint, not {' and '.join(p for p, _ in found)}", found[1][0])
        param, constraint = found[0]
        output_grammar(constraint, param)   # a 400 naming the client's field, before tokenizing
        return constraint

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> tandem_pb2.Sampling:
        if not 1 <= self.n <= MAX_N:
            raise invalid_request(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        # Choice j samples with seed + j: the last one must still fit int64.
        if self.seed is not None and not 0 <= self.seed <= 2**63 - self.n:
            raise invalid_request(f"seed must be in [0, 2**63 - n] (choice j uses seed + j), got {self.seed}", "seed")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        check_stop(stop)
        stop_token_ids = self.stop_token_ids or []
        bad = next((t for t in stop_token_ids if t not in _INT64), None)
        if bad is not None:
            raise invalid_request(f"stop_token_ids must be token ids, got {bad}", "stop_token_ids")
        msg = tandem_pb2.Sampling(stop=stop, stop_token_ids=stop_token_ids, ignore_eos=self.ignore_eos,
                                  cache_salt=self.cache_salt)
        structured = self.structured()
        if structured is not None:
            msg.structured_outputs.CopyFrom(structured)
        values = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                  "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "seed": self.seed, "max_tokens": max_tokens,
                  "logprobs": logprobs}
        for name, value in values.items():
            if value is not None:
                if name in ("max_tokens", "top_k", "logprobs") and value not in _INT32:
                    raise invalid_request(f"{name}={value} is out of range", name)
                setattr(msg, name, value)
        return msg

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[tuple[str, list[int]]]:
        """(text, token_ids) per prompt of the batch."""
        p: Any = self.prompt   # a str or a list, which of the three kinds is checked below
        if isinstance(p, str):
            return [(p, [])]
        if not p:
            raise invalid_request("prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [("", list(p))]
        if all(isinstance(x, str) for x in p):
            return [(x, []) for x in p]
        if all(isinstance(x, list) for x in p):
            return [("", list(x)) for x in p]
        raise invalid_request("prompt must be a string, a list of strings, token ids, or lists of token ids", "prompt")


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"     # JSON text, as OpenAI sends it


class ToolCallMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None   # an assistant turn that called tools
    tool_call_id: str | None = None                   # a role "tool" turn: the call it answers

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None   # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def as_dict(self) -> dict:
        """The tool as chat templates and the JSON schemas get it (transformers passes it as is)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(default_factory=list)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["auto", "none", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


Body = TypeVar("Body", bound=BaseModel)


_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN = b"0" * 20    # 20 digits in a row may be an integer past 64 bits
_NUMBERS = frozenset((int, float, bool, type(None)))
_SCALARS = _NUMBERS | {str}


def _first_problem(data: dict, check_text: bool) -> tuple[str, tuple] | None:
    """("deep", path) of the first value nested deeper than MAX_JSON_DEPTH, or with ``check_text``
    ("text", path) of the first string or key that is not valid Unicode (a key: the object
    holding it). A loop with its own stack, depth first in document order: a body nested
    thousands deep costs no recursion, and a long list of numbers is passed over in C."""
    stack: list[tuple[object, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            if check_text and any(unencodable(key) for key in value):
                return "text", path
            children = list(value.items())
        elif isinstance(value, list):
            if (_NUMBERS if check_text else _SCALARS).issuperset(map(type, value)):
                continue
            children = list(enumerate(value))
        else:
            if check_text and isinstance(value, str) and unencodable(value):
                return "text", path
            continue
        if len(path) >= MAX_JSON_DEPTH:
            return "deep", path
        stack.extend((v, path + (k,)) for k, v in reversed(children))
    return None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _param(loc) -> str | None:
    """A pydantic location as OpenAI's ``param`` ("messages.0.content"), without the tags pydantic
    adds for union members ("str", "list[int]", "TextPart")."""
    keep = [str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or p[:1].isupper()))]
    return ".".join(keep) or None


def _load(raw: bytes) -> tuple[object, bool]:
    """The JSON value, and whether its strings still need checking for lone surrogates. orjson
    (several times faster than json, and it refuses lone surrogates itself) unless it refuses the
    body; json then reads what orjson does not (NaN, Infinity, integers past 64 bits) or says why
    the body is not JSON. A run of 20 digits may be an integer past 64 bits, which orjson would
    turn into a float: json keeps it exact, for a range check that names it."""
    with _gc_paused():
        if _LONG_DIGIT_RUN not in raw.translate(_DIGITS_TO_ZERO):
            try:
                return orjson.loads(raw), False
            except orjson.JSONDecodeError:
                pass
        try:
            return json.loads(raw), True
        except (ValueError, RecursionError) as exc:   # UnicodeDecodeError (bytes that are not UTF-8) is a ValueError
            raise invalid_request(f"the body is not valid JSON: {exc}"[:300]) from None


@contextlib.contextmanager
def _gc_paused():
    """The cyclic garbage collector paused: parsing makes a container per JSON array and object,
    and the collections their number sets off walk them all again and again (3M one-token
    prompts: 1.6 s instead of 0.3 s, the GIL held throughout). Parsed JSON holds no cycles."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_body(raw: bytes, model: type[Body], check_sizes: Callable[[dict], None] | None = None) -> Body:
    """Raw JSON bytes -> ``model``, or RouterError 400 naming the first bad field. ``check_sizes``
    sees the parsed JSON first: counts (prompts, token ids, messages) checked before pydantic
    builds a model per element. CPU-bound for large bodies: the HTTP API calls it off the event loop."""
    data, check_text = _load(raw)
    if not isinstance(data, dict):
        raise invalid_request("the body must be a JSON object")
    if check_sizes is not None:
        try:
            check_sizes(data)
        except RouterError:
            data = None   # freed here, on this thread: the traceback would keep this frame's locals
            raise
    problem = _first_problem(data, check_text)
    if problem is not None and problem[0] == "deep":
        field = clip(str(problem[1][0]))
        raise invalid_request(f"{field} is nested more than {MAX_JSON_DEPTH} levels deep", field)
    if problem is not None:
        param = clip(".".join(map(str, problem[1]))) or None
        raise invalid_request(f"{param or 'the body'} must be valid Unicode (no lone surrogates)", param)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = exc.errors(include_url=False, include_input=False)
        message = "; ".join(f"{_param(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in problems[:8])
        raise invalid_request(clip(message or "invalid request body", 1024),
                              _param(problems[0].get("loc", ())) if problems else None) from None
