"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3) over a paged KV cache.

Runs inside a worker's engine thread. One forward takes a flattened batch of tokens (prefill
chunks first, then decode tokens) with explicit positions and attention metadata. Q/K/V and
gate/up weights are fused at load time (``load_weights``), not at call sites.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from types import ModuleType

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.models import cpu_ops, quant_linear
from engine.models.arch import ArchConfig
from engine.models.layers import (
    GatedMLP,
    PackedLinear,
    RMSNorm,
    RopeInputs,
    RotaryEmbedding,
    TensorParallel,
    apply_rotary,
    pack_linears,
)
from engine.models.quant_linear import QuantizedWeight

# HF parameter name suffix -> (fused parameter, shard index)
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# Tensor parallelism: which dim of an HF tensor is split over the ranks (others are replicated).
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # output features
_ROW_PARALLEL = ("o_proj", "down_proj")                                     # input features


def check_tensor_parallel(cfg: ArchConfig, tensor_parallel_size: int) -> None:
    """ValueError naming the sizes that would work when ``tensor_parallel_size`` cannot split
    the model's heads (each rank holds whole attention and KV heads) or its MLPs (dense,
    experts, shared expert)."""
    tp = tensor_parallel_size
    # Every split dimension: heads, and the intermediate features of each MLP the model has.
    mlps = {}
    if cfg.moe is None or cfg.moe.dense_layers:
        mlps["intermediate_size"] = cfg.intermediate_size
    if cfg.moe is not None:
        mlps["moe_intermediate_size"] = cfg.moe.intermediate_size
        if cfg.moe.shared_intermediate_size:
            mlps["shared_expert_intermediate_size"] = cfg.moe.shared_intermediate_size
    sizes = [cfg.num_kv_heads, cfg.num_heads, *mlps.values()]
    if not any(n % tp for n in sizes):
        return
    valid = [d for d in range(1, cfg.num_kv_heads + 1) if not any(n % d for n in sizes)]
    choices = ", ".join(map(str, valid[:-1])) + (" or " if len(valid) > 1 else "") + str(valid[-1])
    named = ", ".join(f"{name} {n}" for name, n in mlps.items())
    raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {cfg.num_kv_heads} KV heads "
                     f"(and {cfg.num_heads} attention heads, {named}); use --tensor-parallel-size {choices}")


def shard_weight(name: str, tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of an HF-named checkpoint tensor, copied out so the full tensor can be
    dropped as soon as the loader moves on."""
    if tp.size == 1:
        return tensor
    if any(f".{n}." in name for n in _COLUMN_PARALLEL):
        dim = 0
    elif any(f".{n}." in name for n in _ROW_PARALLEL) and name.endswith(".weight"):
        dim = 1
    else:
        return tensor
    return tensor.chunk(tp.size, dim=dim)[tp.rank].clone(memory_format=torch.contiguous_format)


def _near_max(logits: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of every logit within two half-precision roundings of its row's max (one
    rounding is at most 2^-8 relative for bf16, 2^-11 for fp16).

    Scans block maxima first, so only the few blocks that hold a candidate are compared
    element by element: ~10x cheaper than a full-width compare and nonzero at batch 64.
    """
    num_rows, vocab = logits.shape
    block = math.gcd(vocab, block)
    blocks = logits.view(num_rows, vocab // block, block)
    block_max = blocks.amax(dim=-1)
    top = block_max.amax(dim=-1, keepdim=True)
    threshold = top - top.abs() * 2.0 ** -7 - 1e-6
    block_rows, block_ids = (block_max >= threshold).nonzero(as_tuple=True)
    hit, offset = (blocks[block_rows, block_ids] >= threshold[block_rows]).nonzero(as_tuple=True)
    return block_rows[hit], block_ids[hit] * block + offset


class Attention(nn.Module):
    """This rank's heads: ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV heads."""

    def __init__(self, cfg: ArchConfig, backend: ModuleType, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = tp.split(cfg.num_heads), tp.split(cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend
        self.scale = cfg.head_dim ** -0.5
        self.ops: cpu_ops.LayerOps | None = None   # set by LlamaForCausalLM.pack_for_cpu

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(self, rope: RopeInputs, x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache
        if self.q_norm is None and self.ops is not None:
            # rotary of q and k in place and k/v into the cache slots: one C call
            self.ops.rotary_store_kv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope.positions,
                                     rope.cos_table, rope.sin_table, meta.slot_mapping, k_cache, v_cache)
            q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            return self._attend(q, kv_cache, meta)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                          self.head_dim)
            q, k = apply_rotary(qk, rope).split((self.num_heads, self.num_kv_heads), dim=1)
        else:
            assert self.k_norm is not None
            q, k, _ = qkv.split(self.shard_sizes(), dim=-1)
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, kv_cache, meta)

    def _attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Attention of ``q`` over the cache (this step's K/V already in it), then o_proj."""
        k_cache, v_cache = kv_cache
        num_tokens = q.shape[0]
        num_prefill = meta.num_prefill_tokens
        if num_prefill == num_tokens:
            out = self._prefill(q, k_cache, v_cache, meta)
        elif num_prefill == 0:
            out = self._decode(q, k_cache, v_cache, meta)
        else:
            out = torch.cat([self._prefill(q[:num_prefill], k_cache, v_cache, meta),
                             self._decode(q[num_prefill:], k_cache, v_cache, meta)])
        return self.tp.reduce(self.o_proj(out.view(num_tokens, self.q_size)))

    def _prefill(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables,
                                              meta.query_start_loc_host, meta.prefill_seq_lens_host,
                                              self.scale)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                             meta.decode_seq_lens, meta.max_decode_seq_len, self.scale)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: ModuleType, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)   # MoE models swap in theirs

    def forward(self, rope, x, residual, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the previous layer's MLP output not yet added to ``residual`` (None for the
        first layer): each residual add is fused into the norm that follows it."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_norm(self.self_attn(rope, h, kv_cache, meta), residual)
        return self.mlp(h), residual


DUMMY_SCALE = 1e-3   # --load-format dummy's weights: uniform in +-DUMMY_SCALE


class LlamaForCausalLM(nn.Module):
    """Embedding, norms and lm_head are replicated on every TP rank (exact, and the logits
    need no gather); attention and MLP are split as ``tp`` says."""

    def __init__(self, cfg: ArchConfig, backend: ModuleType, rotary: RotaryEmbedding,
                 tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.rotary = rotary  # one table shared by every layer
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.packed_head: PackedLinear | None = None   # set by pack_for_cpu
        self.fused_rotary = False                      # Attention rotates q/k in place (pack_for_cpu)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm.

        ``after_layer(i)`` runs once layer i's K/V is in the cache: a prefill worker ships that
        layer while the next one computes.
        """
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, lookup=not self.fused_rotary)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(rope, x, residual, kv_cache, meta)
            if after_layer is not None:
                after_layer(i)
        return self.norm.add_norm(x, residual)[0]

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 whatever the model dtype: bf16 logits flip near-tied greedy picks.

        A half-precision GEMM rounds its output to the model dtype, so the tokens that could be
        the largest logit (within two roundings of the row's max) are recomputed exactly in
        float32 from the same bf16 hidden state and weights: greedy picks are those of float32
        logits, at the cost of a few dot products.
        """
        weight = self.head_weight
        if self.packed_head is not None:
            logits = self.packed_head(hidden).float()
        else:
            logits = torch.nn.functional.linear(hidden, weight).float()
        if hidden.dtype == torch.float32 or hidden.shape[0] == 0:
            return logits
        rows, cols = _near_max(logits)
        logits[rows, cols] = (hidden[rows].float() * weight[cols].float()).sum(-1)
        return logits

    def pack_for_cpu(self) -> int:
        """Pre-pack every linear layer (and the lm_head) for oneDNN, and switch the norms and
        rotary to the fused C ops when they build; returns how many linears were packed."""
        ops = cpu_ops.load()
        if ops is not None and ops.supports(self.embed_tokens.weight.dtype, self.config.hidden_size,
                                            self.config.head_dim):
            for layer in self.layers:
                assert isinstance(layer, DecoderLayer)
                layer.input_layernorm.ops = layer.post_attention_layernorm.ops = layer.self_attn.ops = ops
                if isinstance(layer.mlp, GatedMLP):
                    layer.mlp.ops = ops
            self.norm.ops = ops
            self.fused_rotary = not self.config.qk_norm
        count = pack_linears(self.layers)
        if self.lm_head is not None:
            self.packed_head = PackedLinear.from_linear(self.lm_head)
        else:
            self.packed_head = PackedLinear(self.embed_tokens.weight, None)
        return count + 1

    def attach_quantized(self, weights: dict[str, QuantizedWeight]) -> list[PackedLinear]:
        """Give each packed linear (after ``pack_for_cpu``) the GGUF blocks of its weight, fusing
        q/k/v and gate/up rows as ``load_weights`` fused the dense ones; returns the linears that
        got them. A fused linear whose parts differ in type stays dense. Tensor-parallel ranks
        keep the dense slices only."""
        if self.tp.size != 1:
            return []
        attached = []

        def attach(linear: nn.Module | None, names: list[str]) -> None:
            parts = [weights.get(name) for name in names]
            if not isinstance(linear, PackedLinear) or any(p is None for p in parts):
                return
            quant = QuantizedWeight.concat([p for p in parts if p is not None])
            if quant is not None and (quant.rows, quant.in_features) == (linear.out_features, linear.in_features):
                linear.quant = quant_linear.interleaved_for(quant, linear.packed.dtype)
                attached.append(linear)

        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            prefix = f"layers.{i}."
            attach(layer.self_attn.qkv_proj, [f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"])
            attach(layer.self_attn.o_proj, [f"{prefix}self_attn.o_proj.weight"])
            assert isinstance(layer.mlp, GatedMLP)
            attach(layer.mlp.gate_up_proj, [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"])
            attach(layer.mlp.down_proj, [f"{prefix}mlp.down_proj.weight"])
        attach(self.packed_head, ["embed_tokens.weight" if self.lm_head is None else "lm_head.weight"])
        return attached

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     device: torch.device) -> None:
        """Install HF-named tensors as this module's parameters, fusing q/k/v and gate/up.

        Each parameter takes its storage from the checkpoint (cast and moved once), so no
        second copy of the weights is ever allocated; every parameter must be covered. Under
        tensor parallelism each rank keeps only its slice (``shard_weight``) of the split ones.
        """
        params = dict(self.named_parameters())
        shards: dict[str, dict[int | None, torch.Tensor]] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: a checkpoint may still carry a copy
            target, shard = name, None
            for hf_name, (fused, index) in _STACKED.items():
                if f".{hf_name}." in name:
                    target, shard = name.replace(hf_name, fused), index
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            shards.setdefault(target, {})[shard] = shard_weight(name, tensor, self.tp)
        for target, param in params.items():
            expected = self._shard_ids(target)
            got = shards.get(target, {})
            missing = [s for s in expected if s not in got]
            if missing:
                raise ValueError(f"checkpoint lacks {target} (shard {missing[0]})")
            shard_shapes = [tuple(got[s].shape) for s in expected]
            if len({shape[1:] for shape in shard_shapes}) > 1:  # torch.cat would raise a RuntimeError
                raise ValueError(f"checkpoint shards of {target} have mismatched shapes {shard_shapes}")
            value = got[None] if expected == [None] else torch.cat([got[s] for s in expected])
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"checkpoint tensor for {target} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(param.shape)}")
            module_name, _, param_name = target.rpartition(".")
            module = self.get_submodule(module_name)
            # Norm weights stay float32 (RMSNorm computes in float32 whatever the model dtype).
            param_dtype = torch.float32 if isinstance(module, RMSNorm) else dtype
            module._parameters[param_name] = nn.Parameter(value.to(device=device, dtype=param_dtype),
                                                          requires_grad=False)

    def init_dummy_weights(self, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        """Random parameters of this module's shapes instead of a checkpoint's (``--load-format
        dummy``): norms 1, every other weight and bias uniform in +-DUMMY_SCALE, as vLLM's dummy
        format draws them, so the residual stream neither grows nor vanishes across layers. The
        same seed gives the same weights on the same device type and TP layout."""
        gen = torch.Generator(device=device).manual_seed(seed)
        for target, param in list(self.named_parameters()):
            module_name, _, param_name = target.rpartition(".")
            module = self.get_submodule(module_name)
            if isinstance(module, RMSNorm):
                value = torch.ones(param.shape, dtype=torch.float32, device=device)
            else:
                value = torch.empty(param.shape, dtype=dtype, device=device).uniform_(
                    -DUMMY_SCALE, DUMMY_SCALE, generator=gen)
            module._parameters[param_name] = nn.Parameter(value, requires_grad=False)

    def _shard_ids(self, param_name: str) -> list[int | None]:
        if ".qkv_proj." in param_name:
            return [0, 1, 2]
        if ".gate_up_proj." in param_name:
            return [0, 1]
        return [None]


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with biases on q/k/v (``ArchConfig.attention_bias``)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with RMSNorm on each head's q and k before rotary (``ArchConfig.qk_norm``)."""


MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
