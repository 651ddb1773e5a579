"""What one benchmark request left behind: its timestamps, lengths and outcome.

Filled in by a backend (``deploy.bench.backends``) in the `tandem bench` process, read by
``deploy.bench.metrics`` and ``deploy.bench.plots``, and stored per request in results.json.
All times are seconds: ``start_s`` from the benchmark's start, the rest from ``start_s``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int                  # prompt tokens by the benchmark's tokenizer (vLLM counts the same way)
    max_tokens: int
    start_s: float = 0.0             # when the request was sent (after the concurrency gate)
    ttft_s: float = 0.0              # first content chunk's arrival - start
    itl_s: list[float] = field(default_factory=list)   # gaps between consecutive content chunks
    e2e_s: float = 0.0               # last stream event's arrival - start
    output_len: int = 0              # usage.completion_tokens when reported, else counted chunks
    success: bool = False
    error: str = ""

    def chunk_times_s(self) -> list[float]:
        """Arrival of each content chunk, seconds from the benchmark's start."""
        if not self.success:
            return []
        times = [self.start_s + self.ttft_s]
        for gap in self.itl_s:
            times.append(times[-1] + gap)
        return times

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RequestRecord:
        return cls(**data)
