"""Find and load model weights: HF safetensors directories and GGUF files.

Runs in every worker process at startup (and in `tandem plan` for the architecture only).
Built-in names resolve to files inside installed packages; nothing is fetched from a hub.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.gguf_file import GGUFFile
from engine.model_errors import ModelFileError
from engine.model_source import ModelSource, load_arch, resolve_model  # noqa: F401 - re-exported
from engine.models.arch import (
    ArchConfig,
)
from engine.models.quant_linear import QuantizedWeight

logger = logging.getLogger(__name__)

_GGUF_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
               "output.weight": "lm_head.weight"}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
}
# A mixture-of-experts layer's experts, stacked: [num_experts, rows, cols] in numpy order. Files
# from llama.cpp before 2024 hold Mixtral's experts one by one instead, as blk.N.ffn_gate.E.weight.
GGUF_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_SPLIT_EXPERT_NAMES = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


class Checkpoint:
    """One opened model: its architecture, weights and GGUF extras, read from disk once."""

    def __init__(self, source: ModelSource) -> None:
        self.source = source
        self.gguf = GGUFFile(source.path) if source.kind == "gguf" else None
        self.arch = load_arch(source)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, float tensor) pairs."""
        if self.gguf is None:
            yield from _iter_safetensors(self.source.path)
        else:
            yield from _iter_gguf(self.gguf, self.arch)

    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        """HF parameter name -> the GGUF blocks of every 2-D weight whose type the quantized
        linear kernel reads (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), rows in the same order as ``weights()`` yields
        them; empty for safetensors checkpoints and for mixture-of-experts models, which attach
        none (``MoEForCausalLM.attach_quantized``)."""
        gguf = self.gguf
        if gguf is None or self.arch.moe is not None:
            return {}
        found = {}
        for tensor in gguf.kernel_tensors():
            name = _gguf_to_hf_name(gguf, tensor.name)
            if name is None:
                continue
            blocks = _hf_row_order(gguf, self.arch, name, np.asarray(tensor.data))
            found[name] = QuantizedWeight.from_blocks(tensor.tensor_type, blocks, tensor.shape[1])
        return found

    def rope_freq_factors(self) -> torch.Tensor | None:
        """Llama 3.1 GGUFs store their rope scaling as per-frequency divisors."""
        gguf = self.gguf
        if gguf is None:
            return None
        for tensor in gguf.tensors:
            if tensor.name == "rope_freqs.weight":
                return torch.from_numpy(gguf.dequantize(tensor))
        return None


def _iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    tensor = handle.get_tensor(name)
                    if not tensor.dtype.is_floating_point:
                        raise ModelFileError(file, f"tensor {name!r}",
                                             f"dtype {tensor.dtype} is not a floating-point type", "safetensors")
                    yield name, tensor
        except SafetensorError as exc:   # header length, JSON, dtypes, offsets: checked by safetensors
            raise ModelFileError(file, "header", str(exc), "safetensors") from None


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp stores Llama q/k rows with each head's rotary halves interleaved;
    # undo that so rotate-half (HF) rotary applies.
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _iter_gguf(gguf: GGUFFile, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named float32 tensors; a stacked expert tensor is dequantized whole, then yielded as
    one HF tensor per expert (``MoEForCausalLM.load_weights`` stacks them again, with its TP slice)."""
    for tensor in gguf.tensors:
        name = _gguf_to_hf_name(gguf, tensor.name)
        if name is None:
            continue
        data = _hf_row_order(gguf, arch, name, gguf.dequantize(tensor))
        if "{expert}" in name:
            for expert, rows in enumerate(torch.from_numpy(data).unbind(0)):
                yield name.format(expert=expert), rows
        else:
            yield name, torch.from_numpy(np.ascontiguousarray(data))


def _hf_row_order(gguf: GGUFFile, arch: ArchConfig, name: str, rows: np.ndarray) -> np.ndarray:
    """A GGUF tensor's rows (dequantized values or quantized blocks) in the HF order."""
    if gguf.metadata.get("general.architecture") not in ("llama", "mistral"):
        return rows
    heads = (arch.num_heads if name.endswith("q_proj.weight") else
             arch.num_kv_heads if name.endswith("k_proj.weight") else 0)
    if not heads:
        return rows
    if rows.ndim != 2 or rows.shape[0] % (2 * heads):
        raise ModelFileError(gguf.path, f"tensor for {name}", f"shape {rows.shape} is not {heads} heads "
                             "of an even number of rows", "GGUF")
    return _unpermute_rope(rows, heads)


def _gguf_to_hf_name(gguf: GGUFFile, name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) not in (4, 5):
        return None  # rope_freqs and other non-parameter tensors
    layer, kind = parts[1], parts[2]
    if len(parts) == 5:   # blk.N.ffn_gate.E.weight: one expert of a pre-2024 Mixtral file
        if kind in _GGUF_SPLIT_EXPERT_NAMES and parts[3].isdigit():
            return f"layers.{layer}.mlp.experts.{int(parts[3])}.{_GGUF_SPLIT_EXPERT_NAMES[kind]}.{parts[4]}"
        return None
    if kind in GGUF_EXPERT_NAMES:   # "{expert}" is filled in per expert by _iter_gguf
        return f"layers.{layer}.mlp.experts.{{expert}}.{GGUF_EXPERT_NAMES[kind]}.{parts[3]}"
    hf = _GGUF_LAYER_NAMES.get(kind)
    if hf is None:
        raise ModelFileError(gguf.path, f"tensor {name!r}", "is not part of a supported Llama-family model", "GGUF")
    return f"layers.{layer}.{hf}.{parts[3]}"
