"""Public sampling options (tandem.v1.Sampling) -> the workers' SamplingParams, validated (router process).

The range checks themselves live in ``engine.config.check_sampling``, the one home the engine
uses too, so the router refuses exactly what a worker would: a bad value is a clear 400 /
INVALID_ARGUMENT naming the field before any worker sees it. On top of those the router checks
what only it knows: the vocabulary (stop_token_ids), the stop strings it applies itself, the
``cache_salt`` it passes on to the workers (which mix it into the first KV block's hash), and
prompt + max_tokens against max_model_len with both numbers in the message. A positive
temperature too small to divide by (denormals included) is raised to MIN_TEMPERATURE, as vLLM does.

Structured outputs become the workers' OutputGrammar here. The router checks what it can without
a grammar engine (engine.config.check_structured: JSON that parses, a non-empty choice list,
sizes); the workers compile with xgrammar and refuse anything else with INVALID_ARGUMENT, which
reaches the client as a 400 before the first token (router/http_api.py holds a structured
stream's headers until then).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.config import (
    DEFAULT_MAX_TOKENS,
    MAX_CACHE_SALT_CHARS,
    InvalidSamplingError,
    check_sampling,
    check_structured,
    clamp_temperature,
)
from protos.tandem.v1 import tandem_pb2, worker_pb2
from router.errors import invalid_request
from router.json_limits import MAX_JSON_DEPTH, loads_bounded

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
_OPTIONAL = frozenset(("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                       "frequency_penalty", "seed", "logprobs"))


@dataclass(frozen=True)
class PreparedSampling:
    params: worker_pb2.SamplingParams      # max_tokens always set
    stop: tuple[str, ...]


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise invalid_request(message, param)


def unencodable(text: str) -> bool:
    """True for text that is not valid Unicode (lone surrogates): protobuf, the tokenizer and
    the JSON error body would all fail on it later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_stop(stop) -> None:
    _check(len(stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
    _check(all(0 < len(x) <= MAX_STOP_STRING_CHARS for x in stop),
           f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters", "stop")
    _check(not any(unencodable(x) for x in stop), "stop strings must be valid Unicode (no lone surrogates)", "stop")


def check_cache_salt(salt: str) -> None:
    _check(0 < len(salt) <= MAX_CACHE_SALT_CHARS,
           f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}", "cache_salt")


def output_grammar(public: tandem_pb2.StructuredOutputs, param: str = "structured_outputs") -> worker_pb2.OutputGrammar:
    """The workers' form of a structured-output constraint; a 400 naming ``param`` if it is bad."""
    kind = public.WhichOneof("kind")
    if kind is None:
        raise invalid_request(f"{param} sets no constraint: give json_schema, json_object, regex, choice or "
                              "grammar", param)
    if kind == "json_object" and not public.json_object:
        raise invalid_request(f"{param}.json_object must be true when given", param)
    if kind == "choice":
        spec = json.dumps(list(public.choice.values))
    else:
        spec = "" if kind == "json_object" else getattr(public, kind)
    try:
        check_structured(kind, spec)
    except ValueError as exc:
        raise invalid_request(f"{param}: {exc}", param) from None
    # A schema given as text escapes the body's depth check, and a deep one takes the workers'
    # grammar compiler minutes (900 nested arrays: 48 s on one core).
    if kind == "json_schema" and loads_bounded(spec) is None:
        raise invalid_request(f"{param}: the JSON schema is nested more than {MAX_JSON_DEPTH} levels deep", param)
    return worker_pb2.OutputGrammar(kind=kind, spec=spec)


def prepare_sampling(public: tandem_pb2.Sampling, num_prompt_tokens: int, max_model_len: int | None,
                     default_max_tokens: int | None, vocab_size: int | None = None) -> PreparedSampling:
    """``default_max_tokens=None`` means "the rest of the context" (chat's default)."""
    s = public
    given = {f.name: value for f, value in s.ListFields()}   # the fields set (one call, on every request)
    values = {name: value for name, value in given.items() if name in _OPTIONAL}
    given_max_tokens = given.get("max_tokens")
    try:
        check_sampling(**values, max_tokens=given_max_tokens, stop_token_ids=s.stop_token_ids, vocab_size=vocab_size)
    except InvalidSamplingError as exc:
        raise invalid_request(str(exc), exc.param) from None
    if s.stop:
        check_stop(s.stop)
    if given_max_tokens is not None:
        max_tokens = given_max_tokens
    elif default_max_tokens is not None:
        max_tokens = default_max_tokens
    elif max_model_len is not None:
        max_tokens = max(max_model_len - num_prompt_tokens, 1)
    else:
        max_tokens = DEFAULT_MAX_TOKENS
    if max_model_len is not None:
        if num_prompt_tokens >= max_model_len:
            raise invalid_request(f"This model's maximum context length is {max_model_len} tokens, but the prompt "
                                  f"has {num_prompt_tokens} tokens; shorten the prompt", "prompt")
        if ((given_max_tokens is not None or default_max_tokens is not None)
                and num_prompt_tokens + max_tokens > max_model_len):
            raise invalid_request(f"This model's maximum context length is {max_model_len} tokens. However, you "
                                  f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                                  f"prompt, {max_tokens} for the completion). Reduce the prompt or max_tokens.",
                                  "max_tokens")
    params = worker_pb2.SamplingParams(stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos,
                                       max_tokens=max_tokens, **values)
    if "temperature" in values:
        params.temperature = clamp_temperature(values["temperature"])
    if "structured_outputs" in given:
        params.grammar.CopyFrom(output_grammar(s.structured_outputs))
    if "cache_salt" in given:
        check_cache_salt(s.cache_salt)
        params.cache_salt = s.cache_salt
    return PreparedSampling(params, tuple(s.stop))
