"""A request's state inside the engine: tokens, KV blocks, progress and finish reason.

Runs in the engine thread of a worker (or of the in-process `LLM`). Pure Python.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.config import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0     # tokens whose K/V is in this sequence's blocks
    num_cached_blocks: int = 0       # leading blocks registered in the prefix cache
    num_prefix_hit_tokens: int = 0   # prompt tokens served from the prefix cache
    finish_reason: str | None = None
    generator: Any = None            # torch.Generator when the request has a seed
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_retractions: int = 0
    grammar: Any = None              # engine.structured.GrammarState when params.structured is set;
                                     # it has accepted every output token so far

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
