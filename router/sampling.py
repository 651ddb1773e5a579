"""Public sampling options (tandem.v1.Sampling) -> the workers' SamplingParams, validated (router process).

The router checks every range the engine would, so a bad value is a clear 400 /
INVALID_ARGUMENT before any worker sees it, and checks prompt + max_tokens against
max_model_len with both numbers in the message.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from protos.tandem.v1 import tandem_pb2, worker_pb2
from router.errors import invalid_request

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class PreparedSampling:
    params: worker_pb2.SamplingParams      # max_tokens always set
    stop: tuple[str, ...]


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise invalid_request(message, param)


def prepare_sampling(public: tandem_pb2.Sampling, num_prompt_tokens: int, max_model_len: int | None,
                     default_max_tokens: int | None) -> PreparedSampling:
    """``default_max_tokens=None`` means "the rest of the context" (chat's default)."""
    s = public
    has = s.HasField
    if has("temperature"):
        _check(math.isfinite(s.temperature) and s.temperature >= 0, f"temperature must be >= 0, got {s.temperature}", "temperature")
    if has("top_p"):
        _check(0.0 < s.top_p <= 1.0, f"top_p must be in (0, 1], got {s.top_p}", "top_p")
    if has("top_k"):
        _check(s.top_k >= -1, f"top_k must be -1, 0 (disabled) or a positive count, got {s.top_k}", "top_k")
    if has("min_p"):
        _check(0.0 <= s.min_p <= 1.0, f"min_p must be in [0, 1], got {s.min_p}", "min_p")
    if has("repetition_penalty"):
        _check(s.repetition_penalty > 0, f"repetition_penalty must be > 0, got {s.repetition_penalty}",
               "repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        if has(name):
            value = getattr(s, name)
            _check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}", name)
    if has("seed"):
        _check(s.seed >= 0, f"seed must be in [0, 2**63), got {s.seed}", "seed")
    if has("logprobs"):
        _check(0 <= s.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}], got {s.logprobs}",
               "logprobs")
    _check(len(s.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}", "stop")
    _check(all(0 < len(x) <= MAX_STOP_STRING_CHARS for x in s.stop),
           f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters", "stop")
    _check(all(t >= 0 for t in s.stop_token_ids), "stop_token_ids must be >= 0", "stop_token_ids")
    if has("max_tokens"):
        _check(s.max_tokens >= 1, f"max_tokens must be >= 1, got {s.max_tokens}", "max_tokens")
        max_tokens = s.max_tokens
    elif default_max_tokens is not None:
        max_tokens = default_max_tokens
    elif max_model_len is not None:
        max_tokens = max(max_model_len - num_prompt_tokens, 1)
    else:
        max_tokens = 16
    if max_model_len is not None:
        _check(num_prompt_tokens < max_model_len,
               f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
               f"{num_prompt_tokens} tokens; shorten the prompt", "prompt")
        if has("max_tokens") or default_max_tokens is not None:
            _check(num_prompt_tokens + max_tokens <= max_model_len,
                   f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                   f"for the completion). Reduce the prompt or max_tokens.", "max_tokens")
    params = worker_pb2.SamplingParams(stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                                       max_tokens=max_tokens)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "logprobs"):
        if has(name):
            setattr(params, name, getattr(s, name))
    return PreparedSampling(params, tuple(s.stop))
