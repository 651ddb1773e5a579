"""Proto <-> engine type conversion and request validation for the worker servicers."""
from __future__ import annotations

from engine.config import SamplingParams, StructuredOutput
from protos.limits import MAX_REQUEST_ID_CHARS
from protos.tandem.v1 import worker_pb2

_OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "max_tokens", "logprobs")


def sampling_from_proto(msg: worker_pb2.SamplingParams) -> SamplingParams:
    """Engine SamplingParams; unset optional fields keep the engine defaults. ValueError if bad."""
    values = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    if msg.HasField("grammar"):
        g = msg.grammar
        values["structured"] = StructuredOutput(g.kind, g.spec)
    return SamplingParams(stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
                          cache_salt=msg.cache_salt, num_resumed_tokens=msg.num_resumed_tokens, **values)


def sampling_to_proto(params: SamplingParams) -> worker_pb2.SamplingParams:
    msg = worker_pb2.SamplingParams(stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                                    temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                    min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                                    presence_penalty=params.presence_penalty,
                                    frequency_penalty=params.frequency_penalty, max_tokens=params.max_tokens,
                                    cache_salt=params.cache_salt, num_resumed_tokens=params.num_resumed_tokens)
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.structured is not None:
        s = params.structured
        msg.grammar.CopyFrom(worker_pb2.OutputGrammar(kind=s.kind, spec=s.spec))
    return msg


def check_request(request_id: str, prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """ValueError with a clear message for anything a worker must refuse."""
    if not request_id:
        raise ValueError("request_id is empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id is {len(request_id)} characters, more than {MAX_REQUEST_ID_CHARS}")
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids is empty: give at least one token")
    if len(prompt_token_ids) > max_model_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, longer than max_model_len={max_model_len}")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")


def logprobs_to_proto(token_id: int, entry: dict[int, float], k: int) -> worker_pb2.TokenLogprobs:
    """The sampled token's logprob plus the top ``k`` (entry holds both, sampled first)."""
    top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
    return worker_pb2.TokenLogprobs(token_id=token_id, logprob=entry[token_id],
                                    top_token_ids=[t for t, _ in top], top_logprobs=[lp for _, lp in top])
