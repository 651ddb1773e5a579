"""Write a tiny Hugging Face checkpoint (tests/models.py) as a GGUF file laid out the way
llama.cpp's convert_hf_to_gguf.py lays one out, for the GGUF loading tests.

What follows llama.cpp: the architecture names (Mixtral is written as ``llama`` with an expert
count), the metadata keys, each expert's three projections stacked into one 3-D tensor
(``[experts, rows, cols]`` in numpy order) or, for ``split_experts``, one tensor per expert as
llama.cpp wrote Mixtral before 2024 (``blk.N.ffn_gate.E.weight``), Llama-layout q/k rows with
each head's rotary halves interleaved, and the router left in float32 when the rest is quantized.
Tensor names come from gguf-py's own table (``gguf.get_tensor_name_map``), not from
engine/loader.py, so a name the loader gets wrong fails the tests instead of agreeing with itself.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

# HF architecture -> GGUF architecture
GGUF_ARCH = {"Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "llama", "LlamaForCausalLM": "llama",
             "Qwen3ForCausalLM": "qwen3"}
_EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight")
_STACKED = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\w+)\.weight")


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute: each head's two rotary halves interleaved
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored_values(values: np.ndarray, qtype: Any) -> np.ndarray:
    """What a GGUF file of type ``qtype`` holds for ``values``, read back as float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    if qtype == GGMLQuantizationType.F32:
        return values
    return dequantize(quantize(values, qtype), qtype).astype(np.float32).reshape(values.shape)


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert HF tensors -> one ``[experts, rows, cols]`` tensor per layer and projection,
    named as convert_hf_to_gguf.py names the merged tensor before mapping it."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, values in tensors.items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            out[name] = values
        else:
            experts.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = values
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def _per_expert(name: str, values: np.ndarray) -> dict[str, torch.Tensor]:
    """A stacked expert tensor as the HF tensors it came from; any other tensor as itself."""
    stacked = _STACKED.fullmatch(name)
    if stacked is None:
        return {name: torch.from_numpy(values)}
    return {f"{stacked[1]}.{e}.{stacked[2]}.weight": torch.from_numpy(rows.copy()) for e, rows in enumerate(values)}


def _header(writer: Any, cfg: dict[str, Any], gguf_arch: str) -> None:
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    if cfg.get("head_dim", hidden // heads) != hidden // heads:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))))
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if gguf_arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def _tokenizer(writer: Any, metadata: Mapping[str, Any]) -> None:
    from gguf import GGUFValueType

    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, int) and not isinstance(value, bool):
            writer.add_uint32(key, value)
        else:
            writer.add_key_value(key, value, GGUFValueType.get_type(value))


def write_gguf(model_dir: Path, path: Path, tokenizer_metadata: Mapping[str, Any],
               qtypes: Mapping[str, Any] | None = None, split_experts: bool = False,
               edit: Callable[[str, np.ndarray], np.ndarray | None] | None = None,
               omit_keys: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Write ``model_dir``'s checkpoint to ``path``; ``qtypes`` maps a GGUF tensor kind
    (``attn_q``, ``ffn_gate_exps``, ``token_embd``...) to the type it is stored in (float32 when
    absent). Returns HF name -> the values the file holds, for every tensor stored quantized.

    To make broken files: ``edit(gguf_name, values)`` returns the values to write instead (None
    leaves the tensor out), and ``omit_keys`` names metadata keys to leave out."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    gguf_arch = GGUF_ARCH[cfg["architectures"][0]]
    arch_id = next(a for a, arch_name in gguf.MODEL_ARCH_NAMES.items() if arch_name == gguf_arch)
    name_map = gguf.get_tensor_name_map(arch_id, cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    _header(writer, cfg, gguf_arch)
    _tokenizer(writer, tokenizer_metadata)
    for key in omit_keys:
        del writer.kv_data[0][key]   # gguf 0.19 keeps the header's keys per output shard
    stored: dict[str, torch.Tensor] = {}
    hf_tensors = {k: v.astype(np.float32) for k, v in load_file(model_dir / "model.safetensors").items()}
    tensors = hf_tensors if split_experts else _stack_experts(hf_tensors)
    for hf_name, values in tensors.items():
        expert = _EXPERT.fullmatch(hf_name)
        # A split expert is named as its stacked tensor would be, with the expert id added.
        lookup = f"{expert[1]}.{expert[3]}.weight" if expert else hf_name
        name = name_map.get_name(lookup, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"gguf-py maps no GGUF name to {lookup}"
        if expert:
            name = name.replace("_exps.", f".{expert[2]}.")
        kind = name.split(".")[-2] if not expert else name.split(".")[2] + "_exps"
        qtype = (qtypes or {}).get(kind, gguf.GGMLQuantizationType.F32)
        if values.ndim < 2 or kind == "ffn_gate_inp":   # llama.cpp keeps norms and the router in float32
            qtype = gguf.GGMLQuantizationType.F32
        if qtype != gguf.GGMLQuantizationType.F32:
            stored.update(_per_expert(hf_name, stored_values(values, qtype)))
        if gguf_arch == "llama" and kind in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"]
            values = _llama_cpp_permute(values, heads)
        if edit is not None:
            edited = edit(name, values)
            if edited is None:
                continue
            values = edited
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored
