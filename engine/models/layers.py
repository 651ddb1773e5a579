"""Building blocks of Llama-family models: RMSNorm, rotary embedding, gated MLP.

Runs inside a worker's engine thread. Each module is a few lines; weights are plain
parameters filled by the loader.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its TP group, as the model layers see it.

    Column-parallel layers (q/k/v, gate/up) hold this rank's slice of the output features;
    row-parallel layers (o_proj, down_proj) hold the matching slice of the input features and
    sum their partial outputs over the ranks with ``all_reduce`` (in place).
    """

    rank: int = 0
    size: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.all_reduce is None else self.all_reduce(x)

    def split(self, n: int) -> int:
        """This rank's share of ``n`` heads / features (divisibility was checked at startup)."""
        return n // self.size


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    inv_freq = 1.0 / theta ** exponents
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        # Llama 3.1: leave high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, blended))
    return inv_freq


class RotaryEmbedding:
    """Rotate-half (NeoX/HF) rotary embedding with a precomputed float32 cos/sin table.

    A plain object, not a module: the table is built on ``device`` directly, so models can be
    constructed on the meta device and still get a real table.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, device: torch.device,
                 freq_factors: torch.Tensor | None = None) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64, device="cpu"), inv_freq)
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[num_tokens, 1, head_dim / 2]``, looked up once per forward."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``[num_tokens, num_heads, head_dim]`` by the positions' angles (float32 math)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.tp = tp
        local = tp.split(intermediate)
        self.gate_up_proj = nn.Linear(hidden, 2 * local, bias=False)   # column-parallel
        self.down_proj = nn.Linear(local, hidden, bias=False)          # row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.reduce(self.down_proj(F.silu(gate) * up))
