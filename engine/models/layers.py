"""Building blocks of Llama-family models: RMSNorm, rotary embedding, gated MLP.

Runs inside a worker's engine thread. Each module is a few lines; weights are plain
parameters filled by the loader.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import quant_linear

if TYPE_CHECKING:
    from engine.models.cpu_ops import LayerOps
    from engine.models.quant_linear import QuantizedWeight


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
    """RMSNorm with its weight kept in float32 and statistics computed in float32 whatever the
    model dtype; the output is rounded once to the input's dtype.

    ``add_norm`` fuses the residual add that precedes every norm of a decoder layer. The
    residual stream stays float32 for half-precision models: rounding it to bf16 at every layer
    is enough to flip SmolLM2's near-tied first answer token ("The" vs "L"). ``ops`` (set by
    ``LlamaForCausalLM.pack_for_cpu``) runs the add and the norm as one C call.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: LayerOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x) in x's dtype, residual + x in float32); None starts the stream."""
        if self.ops is not None:
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x.float() if residual is None else residual + x
        return F.rms_norm(residual, (x.shape[-1],), self.weight, self.eps).to(x.dtype), residual


class PackedLinear(nn.Module):
    """A bias-optional linear layer whose weight oneDNN reordered once, at load, into its blocked
    layout (what inductor's freezing does for CPU linears): no per-call weight reorder, and
    GEMV/GEMM kernels that stream the weight at close to memory bandwidth. CPU only.

    A GGUF model's linears may also hold their quantized blocks (``quant``, set by
    ``LlamaForCausalLM.attach_quantized``): inputs of at most ``quant_max_batch`` rows (decode
    steps) are then multiplied from the blocks, which read several times fewer bytes
    (``engine/models/quant_linear.py``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = None if bias is None else bias.detach()
        self.quant: QuantizedWeight | None = None
        self.quant_max_batch = 0
        # The row-major bf16 weight for the AMX kernel (``rows_linear``), used by steps of up to
        # ``rows_max_batch`` tokens; ModelRunner.tune_kernels keeps it only where it measured faster.
        # Not with a bias: the kernel rounds to bf16 before the bias is added, oneDNN after.
        self.rows: torch.Tensor | None = (weight.detach().contiguous()
                                          if quant_linear.amx_rows_available(weight.dtype) and bias is None
                                          and self.in_features % 32 == 0 else None)
        self.rows_max_batch = 0

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # unquantized_forward's choice written out: a decode step calls this ~120 times
        if x.shape[0] <= self.quant_max_batch and self.quant is not None:
            return self.quantized_forward(x)
        if x.shape[0] <= self.rows_max_batch and self.rows is not None:
            return self.rows_forward(x)
        return self.dense_forward(x)

    def unquantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.rows_max_batch and self.rows is not None:
            return self.rows_forward(x)
        return self.dense_forward(x)

    def rows_forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.rows is not None
        return quant_linear.rows_linear(x, self.rows, self.bias)

    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.quant is not None
        return quant_linear.linear(x, self.quant, self.bias)


def can_pack_linear(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


def pack_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a ``PackedLinear``; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear.from_linear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    inv_freq = 1.0 / theta ** exponents
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
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
    """Rotate-half (NeoX/HF) rotary embedding with precomputed float32 tables.

    A plain object, not a module: the tables are built on ``device`` directly, so models can be
    constructed on the meta device and still get real tables. They are stored full width
    (``cos`` repeated, ``sin`` with the first half negated) so one rotation is a multiply and a
    fused multiply-add: ``x * cos + rotate_half(x) * sin``.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, device: torch.device,
                 freq_factors: torch.Tensor | None = None) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64, device="cpu"), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        self.cos = torch.cat((cos, cos), dim=-1).float().to(device)
        self.sin = torch.cat((-sin, sin), dim=-1).float().to(device)

    def __call__(self, positions: torch.Tensor, lookup: bool = True) -> RopeInputs:
        """A forward's rotary inputs; ``lookup`` gathers cos and sin ``[num_tokens, 1, head_dim]``
        once for every layer (the fused CPU op reads the tables by position itself)."""
        if not lookup:
            return RopeInputs(positions, self.cos, self.sin)
        return RopeInputs(positions, self.cos, self.sin, self.cos[positions].unsqueeze(1),
                          self.sin[positions].unsqueeze(1))


@dataclass(frozen=True)
class RopeInputs:
    positions: torch.Tensor               # [num_tokens] int64
    cos_table: torch.Tensor               # [max_positions, head_dim] float32
    sin_table: torch.Tensor
    cos: torch.Tensor | None = None       # [num_tokens, 1, head_dim], when looked up
    sin: torch.Tensor | None = None


def apply_rotary(x: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
    """Rotate ``[num_tokens, num_heads, head_dim]`` by the positions' angles (float32 math)."""
    cos, sin = rope.cos, rope.sin
    assert cos is not None and sin is not None, "RotaryEmbedding looks them up unless rotary is fused"
    xf = x.float()
    half = x.shape[-1] // 2
    swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)   # rotate_half, sign is in `sin`
    return torch.addcmul(xf * cos, swapped, sin).to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU with gate and up projections fused into one matmul; ``ops`` (set by
    ``LlamaForCausalLM.pack_for_cpu``) runs silu(gate) * up as one C call."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.tp = tp
        local = tp.split(intermediate)
        self.gate_up_proj = nn.Linear(hidden, 2 * local, bias=False)   # column-parallel
        self.down_proj = nn.Linear(local, hidden, bias=False)          # row-parallel
        self.ops: LayerOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None and gate_up.dim() == 2:
            return self.tp.reduce(self.down_proj(self.ops.silu_mul(gate_up)))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.tp.reduce(self.down_proj(F.silu(gate).mul_(up)))
