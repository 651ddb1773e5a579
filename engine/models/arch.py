"""Architecture hyper-parameters of a Llama-family model (dense, or mixture-of-experts MLPs
beside Llama attention), read from HF config.json or GGUF.

Runs wherever a model is loaded or planned (workers, `tandem plan`). Pure Python.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", *MOE_ARCHITECTURES)
# llama.cpp's general.architecture -> ours. Mixtral is written as "llama" with an expert count.
_GGUF_ARCHES = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
_GGUF_MOE_ARCHES = {"llama": "MixtralForCausalLM", "mistral": "MixtralForCausalLM"}
_ROPE_TYPES = ("default", "linear", "llama3")
_QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
_ALWAYS_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts model: ``num_experts`` gated-SiLU experts of
    ``intermediate_size`` each, ``top_k`` of them per token, and optionally one shared expert
    every token goes through (Qwen2-MoE), scaled by a sigmoid gate."""

    num_experts: int
    top_k: int
    intermediate_size: int
    # Softmax over all experts, then top-k; True divides the k weights by their sum, which is
    # a softmax over the top-k logits (Mixtral always; Qwen with norm_topk_prob).
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()   # layers whose MLP is dense (Qwen's mlp_only_layers / sparse step)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be between 1 and the "
                             f"{self.num_experts} experts")
        if self.intermediate_size <= 0 or self.shared_intermediate_size < 0:
            raise ValueError(f"expert intermediate sizes must be positive (moe_intermediate_size="
                             f"{self.intermediate_size}, shared_expert_intermediate_size="
                             f"{self.shared_intermediate_size})")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def layer_params(self, hidden: int, active: bool = False) -> int:
        """Parameters of one sparse MLP (router, experts, shared expert and its gate); ``active``
        counts only the ``top_k`` experts a token runs through."""
        experts = self.top_k if active else self.num_experts
        params = experts * 3 * hidden * self.intermediate_size + self.num_experts * hidden
        if self.shared_intermediate_size:
            params += 3 * hidden * self.shared_intermediate_size + hidden
        return params


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None   # attention window; None = full causal attention
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None          # None = every layer has a dense gated MLP

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; Tandem supports "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if (self.moe is None) == (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(f"{self.architecture} {'needs' if self.moe is None else 'takes no'} "
                             "mixture-of-experts settings")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope scaling type {rope_type!r} is not supported; use one of {_ROPE_TYPES}")

    @property
    def num_params(self) -> int:
        """Parameter count, every expert included (embeddings counted once when tied)."""
        return self._count_params(active=False)

    @property
    def num_active_params(self) -> int:
        """Parameters one token runs through: ``num_params`` less the experts it is not routed to."""
        return self._count_params(active=True)

    def _count_params(self, active: bool) -> int:
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        mlps = sum(self.mlp_params(i, active) for i in range(self.num_layers))
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + 2 * d) + mlps + emb + d

    def mlp_params(self, layer: int, active: bool = False) -> int:
        if self.moe is not None and self.moe.is_sparse(layer):
            return self.moe.layer_params(self.hidden_size, active)
        return 3 * self.hidden_size * self.intermediate_size

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes rope_parameters; older configs have rope_theta + rope_scaling.
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, scaling or None


def arch_from_hf_config(cfg: dict[str, Any]) -> ArchConfig:
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; Tandem supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; Tandem supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = _rope_from_hf(cfg)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ArchConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // max(num_heads, 1)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch in _QKV_BIAS))),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        # Mistral always windows when the config names a window; Qwen only with use_sliding_window.
        sliding_window=(cfg.get("sliding_window") if arch in _ALWAYS_WINDOWED or cfg.get("use_sliding_window")
                        else None),
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        moe=_moe_from_hf(arch, cfg),
    )


def _moe_from_hf(arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
    if arch not in MOE_ARCHITECTURES:
        return None
    num_layers = int(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return MoEConfig(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                         intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    # Qwen: transformers >= 5 writes num_local_experts, the published configs num_experts. A
    # layer is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid.
    step = int(cfg.get("decoder_sparse_step", 1))
    mlp_only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(num_layers) if i in mlp_only or step <= 0 or (i + 1) % step)
    return MoEConfig(num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
                     top_k=int(cfg["num_experts_per_tok"]),
                     intermediate_size=int(cfg["moe_intermediate_size"]),
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                     dense_layers=dense)


def load_hf_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: an HF model directory needs config.json")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def arch_from_gguf_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ArchConfig:
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in _GGUF_ARCHES:
        raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; Tandem supports "
                         f"{', '.join(sorted(_GGUF_ARCHES))} ({', '.join(SUPPORTED_ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{gguf_arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {gguf_arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    scaling = None
    scaling_type = meta.get(f"{gguf_arch}.rope.scaling.type")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    vocab = meta.get(f"{gguf_arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    architecture = _GGUF_ARCHES[gguf_arch]
    if gguf_arch in _GGUF_MOE_ARCHES and meta.get(f"{gguf_arch}.expert_count"):
        architecture = _GGUF_MOE_ARCHES[gguf_arch]
    return ArchConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(meta.get(f"{gguf_arch}.attention.key_length", hidden // max(num_heads, 1))),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rope_scaling=scaling,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        moe=_moe_from_gguf(architecture, get),
    )


def _moe_from_gguf(architecture: str, get: Callable[..., Any]) -> MoEConfig | None:
    """The expert keys as llama.cpp reads them: every layer is sparse and the top-k weights are
    renormalised (Mixtral's rule; llama.cpp applies it to every Qwen3-MoE, whose published
    models all set norm_topk_prob). An expert's width is feed_forward_length for Mixtral
    (written as "llama"), expert_feed_forward_length for Qwen3-MoE (else n_ff / top_k)."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    top_k = int(get("expert_used_count"))
    if architecture == "MixtralForCausalLM":
        width = int(get("feed_forward_length"))
    else:
        width = int(get("expert_feed_forward_length", int(get("feed_forward_length")) // max(top_k, 1)))
    return MoEConfig(num_experts=int(get("expert_count")), top_k=top_k, intermediate_size=width,
                     norm_topk_prob=True)
