"""Frozen configs of `tandem bench` (client side, in the user's shell process).

One dataclass per concern: where requests go (``EndpointConfig``), what they say
(``WorkloadConfig``), when they leave (``LoadConfig``) and what counts as good (``SloConfig``).
CLI flags map 1:1 onto the fields; ``__post_init__`` says which flag to change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BACKENDS = ("openai-chat", "openai", "grpc")
DATASETS = ("random", "shared-prefix", "mixed", "jsonl")
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EndpointConfig:
    backend: str = "openai-chat"
    base_url: str = "http://127.0.0.1:8000"
    grpc_target: str = "127.0.0.1:50051"
    api_key: str = ""
    model: str = DEFAULT_MODEL
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend != "grpc" and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout-s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: str = "random"
    dataset_path: str | None = None
    tokenizer: str = DEFAULT_MODEL
    num_prompts: int | None = None      # None: 100 synthetic prompts, or every line of the JSONL file
    seed: int = 0
    input_len: int = 1024               # random
    output_len: int = 128               # every dataset; the JSONL default for lines without max_tokens
    num_groups: int = 8                 # shared-prefix
    prefix_len: int = 1024
    suffix_len: int = 64
    short_len: int = 128                # mixed
    long_len: int = 4096
    long_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if (self.dataset == "jsonl") != (self.dataset_path is not None):
            raise ValueError("--dataset-path goes with the JSONL dataset only (it selects it)")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        for flag, value in (("--input-len", self.input_len), ("--output-len", self.output_len),
                            ("--num-groups", self.num_groups), ("--prefix-len", self.prefix_len),
                            ("--suffix-len", self.suffix_len), ("--short-len", self.short_len),
                            ("--long-len", self.long_len)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"--long-fraction must be in [0, 1], got {self.long_fraction}")


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf      # mean requests/s of a Poisson process; inf = all at t=0
    max_concurrency: int | None = None  # None: no cap on requests in flight
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class SloConfig:
    """Per-request service-level objectives; goodput counts completed requests meeting all given."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for flag, value in (("--slo-ttft-ms", self.ttft_ms), ("--slo-tpot-ms", self.tpot_ms)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None
