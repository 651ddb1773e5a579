"""Capacity arithmetic shared by the engine's startup log and `tandem plan` (pure Python)."""
from __future__ import annotations

from engine.math_utils import cdiv


def capacity_lines(num_blocks: int, block_size: int, max_model_len: int) -> tuple[str, str]:
    """The two startup lines operators grep for (docs/architecture.md#kv-cache)."""
    num_tokens = num_blocks * block_size
    blocks_per_request = cdiv(max_model_len, block_size)
    concurrency = num_blocks // blocks_per_request
    return (f"num_blocks_global: {num_blocks}",
            f"KV cache: {num_blocks} blocks x {block_size} tokens = {num_tokens} tokens; "
            f"~{concurrency} concurrent requests at {max_model_len} tokens/request")
