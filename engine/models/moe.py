"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE over the Llama attention stack.

Runs inside a worker's engine thread. Attention, norms, rotary, the KV cache and its transfer
are ``engine/models/llama.py``'s; only the MLP of a sparse layer differs: a router picks
``top_k`` experts per token and the token's output is their weighted sum (plus a sigmoid-gated
shared expert for Qwen2-MoE).

The experts run as grouped GEMMs. On the CPU (``grouped_experts``, also the reference) every
(token, expert) pair is sorted by expert, then each expert that got tokens multiplies all of its
rows in one matmul (a loop over experts, never over tokens), and the weighted rows are summed
back into their tokens with one ``index_add_``. On CUDA ``engine/models/fused_moe.py`` does the
same in two Triton launches for all experts (gate/up with SiLU * up, then down with the routing
weight), without reading the expert counts back to the host.

Tensor parallelism splits every expert like a dense MLP: each rank holds all experts with its
slice of their intermediate features (gate/up column-parallel, down row-parallel) and one
all-reduce sums the layer's output; the router is replicated.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.arch import ArchConfig, MoEConfig
from engine.models.layers import GatedMLP, PackedLinear, RotaryEmbedding, TensorParallel
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.models.quant_linear import QuantizedWeight

# layers.<i>.<mlp|block_sparse_moe>.experts.<e>.<projection>.weight, as HF checkpoints name them
_EXPERT = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
# Mixtral's w1/w3/w2 are Qwen's gate_proj/up_proj/down_proj.
_PROJECTION = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` float32, expert ids ``[T, k]``): softmax over all experts in float32,
    the ``top_k`` largest, renormalised to sum to 1 when ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


class Experts(nn.Module):
    """All experts of one layer as two stacked weights: ``w13`` ``[E, 2 * f_local, hidden]``
    (each expert's gate rows, then its up rows) and ``w2`` ``[E, hidden, f_local]``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TensorParallel) -> None:
        super().__init__()
        local = tp.split(intermediate)
        self.num_experts = num_experts
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, local), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, hidden]``: each token's experts' outputs weighted by ``weights``."""
        if x.is_cuda:
            from engine.models import fused_moe  # Triton is installed only where CUDA is
            return fused_moe.fused_experts(x, self.w13, self.w2, weights, expert_ids)
        return grouped_experts(x, self.w13, self.w2, weights, expert_ids)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    expert_ids: torch.Tensor) -> torch.Tensor:
    """``Experts.forward`` in torch, one gate/up and one down matmul per expert that got tokens:
    the CPU path and the reference for the Triton one."""
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.flatten()
    # Pair p = token * top_k + slot; sorting pairs by expert makes each expert's rows one run.
    order = flat_ids.argsort(stable=True)
    token_of_pair = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = x[token_of_pair]
    out = torch.empty(rows.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate, up = F.linear(rows[start:end], w13[expert]).chunk(2, dim=-1)
        out[start:end] = F.linear(F.silu(gate).mul_(up), w2[expert])
        start = end
    out.mul_(weights.flatten()[order].unsqueeze(1))
    return torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device).index_add_(
        0, token_of_pair, out)


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) a shared expert; one all-reduce for all of them."""

    def __init__(self, cfg: ArchConfig, moe: MoEConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)   # the router, replicated
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, moe.shared_intermediate_size, tp)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, expert_ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # This rank's partial shared output; the sigmoid scale commutes with the sum over ranks.
            gate, up = self.shared_expert.gate_up_proj(x).chunk(2, dim=-1)
            shared = self.shared_expert.down_proj(F.silu(gate).mul_(up))
            out += torch.sigmoid(self.shared_expert_gate(x).float()) * shared.float()
        return self.tp.reduce(out.to(x.dtype))


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama decoder whose sparse layers' MLP is a ``SparseMoeBlock``; ``ArchConfig.moe`` says
    which layers are sparse. GGUF quantized kernels are not attached to experts (safetensors only)."""

    def __init__(self, cfg: ArchConfig, backend: ModuleType, rotary: RotaryEmbedding,
                 tp: TensorParallel = TensorParallel()) -> None:
        super().__init__(cfg, backend, rotary, tp)
        moe = cfg.moe
        assert moe is not None, "ArchConfig checks that an MoE architecture has its settings"
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            if moe.is_sparse(i):
                layer.mlp = SparseMoeBlock(cfg, moe, tp)

    def attach_quantized(self, weights: dict[str, QuantizedWeight]) -> list[PackedLinear]:
        return []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     device: torch.device) -> None:
        """``LlamaForCausalLM.load_weights`` after each layer's per-expert tensors are stacked
        (and sliced for this TP rank) into ``experts.w13`` / ``experts.w2``."""
        super().load_weights(self._stacked_experts(weights), dtype, device)

    def _stacked_experts(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        moe = self.config.moe
        assert moe is not None
        pending: dict[int, dict[tuple[int, str], torch.Tensor]] = {}   # layer -> (expert, part) -> tensor
        for hf_name, tensor in weights:
            name = hf_name.replace(".block_sparse_moe.", ".mlp.")
            match = _EXPERT.search(name)
            if match is None:
                yield name, tensor
                continue
            layer, expert, part = int(match[1]), int(match[2]), _PROJECTION.get(match[3])
            if part is None or expert >= moe.num_experts or not 0 <= layer < self.config.num_layers:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__} "
                                 f"({moe.num_experts} experts, {self.config.num_layers} layers)")
            parts = pending.setdefault(layer, {})
            # Column-parallel gate/up keep this rank's rows, row-parallel down its columns.
            parts[expert, part] = tensor.chunk(self.tp.size, dim=1 if part == "down" else 0)[self.tp.rank]
            if len(parts) == 3 * moe.num_experts:
                del pending[layer]
                prefix = f"layers.{layer}.mlp.experts"
                experts = range(moe.num_experts)
                yield f"{prefix}.w13", torch.stack([torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in experts])
                yield f"{prefix}.w2", torch.stack([parts[e, "down"] for e in experts])
        for layer, parts in pending.items():
            missing = sorted({(e, p) for e in range(moe.num_experts) for p in ("gate", "up", "down")} - set(parts))
            expert, part = missing[0]
            raise ValueError(f"checkpoint lacks layer {layer}'s expert {expert} {part} projection "
                             f"({len(missing)} expert tensors of that layer missing)")


class MixtralForCausalLM(MoEForCausalLM):
    """Mistral attention; 8 experts, top 2, weights a softmax over the chosen experts' logits."""


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2 attention (q/k/v bias); routed experts plus a sigmoid-gated shared expert."""


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3 attention (q/k norm); top-k of a softmax over all experts, renormalised when
    ``norm_topk_prob``; ``mlp_only_layers`` / ``decoder_sparse_step`` layers keep a dense MLP."""


MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
