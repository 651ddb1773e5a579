"""OpenAI / vLLM request bodies (pydantic) and their mapping onto tandem.v1.Sampling (router process).

Unknown fields are ignored, like OpenAI and vLLM do. Ranges are checked in router.sampling, the
one place both APIs share, so a bad value reads the same over HTTP and gRPC.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from protos.tandem.v1 import tandem_pb2
from router.errors import invalid_request

MAX_N = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


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

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> tandem_pb2.Sampling:
        if not 1 <= self.n <= MAX_N:
            raise invalid_request(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise invalid_request(f"seed must be in [0, 2**63), got {self.seed}", "seed")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        msg = tandem_pb2.Sampling(stop=stop, stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos)
        values = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                  "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "seed": self.seed, "max_tokens": max_tokens,
                  "logprobs": logprobs}
        for name, value in values.items():
            if value is not None:
                if name in ("max_tokens", "top_k", "logprobs") and not -2**31 <= value < 2**31:
                    raise invalid_request(f"{name}={value} is out of range", name)
                setattr(msg, name, value)
        return msg

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[tuple[str, list[int]]]:
        """(text, token_ids) per prompt of the batch."""
        p = self.prompt
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(default_factory=list)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
