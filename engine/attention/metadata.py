"""Per-forward attention metadata, built by the model runner and passed explicitly.

A flattened batch holds the tokens of every prefill chunk first, then one token per decoding
sequence. Token ``t`` of the batch stores its K/V at ``slot_mapping[t]``, where
slot = block_id * block_size + offset_in_block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [num_tokens] int64, where each new token's K/V goes
    num_prefills: int
    num_prefill_tokens: int
    query_start_loc: torch.Tensor       # [num_prefills + 1] int32, offsets into prefill tokens
    prefill_seq_lens: torch.Tensor      # [num_prefills] int32, context incl. this chunk
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    decode_seq_lens: torch.Tensor       # [num_decodes] int32, context incl. this token
    decode_block_tables: torch.Tensor   # [num_decodes, max_blocks] int32
    # Host copies, so the torch path never syncs on the device to learn shapes.
    query_start_loc_host: tuple[int, ...] = ()
    prefill_seq_lens_host: tuple[int, ...] = ()
    max_decode_seq_len: int = 0

    @property
    def num_decodes(self) -> int:
        return int(self.decode_seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
