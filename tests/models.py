"""The test models: tiny random-weight Hugging Face checkpoints, and helpers that compare with them.

``build_tiny_checkpoint(name, path, tokenizer_files)`` writes a 2-layer checkpoint of one of the
supported architectures with transformers itself, saved as safetensors next to the SmolLM2
tokenizer, so the same directory serves ``LLM(dir)`` and ``AutoModelForCausalLM``. Weights are
drawn with a fixed seed and a large enough scale that logits spread over several units: greedy
picks then never hinge on float rounding, and a wrong weight or rotary detail changes them.
The session fixtures that build them once (``tiny_model_dir``, ``smollm2_gguf``, ...) are in
tests/conftest.py.
"""
from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 49152  # SmolLM2's vocabulary, so the saved tokenizer fits every tiny model
BLOCK_SIZE = 16

_COMMON = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-6}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# name -> (transformers config class, model class, config overrides)
_DENSE_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM",
                    {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE, "rope_theta": 10000.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),    # q/k/v bias
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": False}),   # q/k norm
}
TINY_ARCHS = tuple(_DENSE_SPECS)
# Mixture-of-experts: 2 layers of 4-8 experts of 32 features (TP=2 splits each in half).
_MOE = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}
TINY_MOE_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Qwen3-30B-A3B's routing: every layer sparse, top-k renormalised.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"tie_word_embeddings": False, **_MOE, "norm_topk_prob": True}),
    # Raw softmax weights; layer 0 keeps a dense MLP (decoder_sparse_step=2).
    "qwen3_moe_step2": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        {"tie_word_embeddings": True, **_MOE, "num_experts_per_tok": 3, "norm_topk_prob": False,
                         "decoder_sparse_step": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"tie_word_embeddings": False, "intermediate_size": 32, "num_local_experts": 4,
                 "num_experts_per_tok": 2, "sliding_window": None}),
    # A shared expert beside the routed ones; layer 1 dense through mlp_only_layers.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"tie_word_embeddings": False, **_MOE, "num_experts_per_tok": 3, "norm_topk_prob": False,
                   "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]}),
}
TINY_MOE_ARCHS = tuple(TINY_MOE_SPECS)
TINY_SPECS = {**_DENSE_SPECS, **TINY_MOE_SPECS}

SMOLLM2 = "smollm2-135m-instruct"


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF init (std 0.02, zero biases, unit norms) gives near-uniform logits and would leave
    # bias and norm loading untested; these scales keep every parameter visible in the output.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.2 * noise)


def build_tiny_checkpoint(name: str, path: Path, tokenizer_files: Path) -> Path:
    """Write the tiny checkpoint of architecture ``name`` (a key of TINY_SPECS) into ``path``."""
    import transformers

    config_cls, model_cls, overrides = TINY_SPECS[name]
    # deepcopy: transformers writes rope_theta into the rope_scaling dict it is given.
    config = getattr(transformers, config_cls)(**copy.deepcopy({**_COMMON, **overrides}))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    _randomize(model, seed=sum(map(ord, name)))
    model.save_pretrained(path, safe_serialization=True)
    for file in tokenizer_files.iterdir():
        shutil.copy(file, path / file.name)
    return path


def hf_greedy(hf: torch.nn.Module, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate``, never stopping at eos (like ``ignore_eos=True``)."""
    ids = torch.tensor([prompt_token_ids])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt_token_ids):].tolist()
    assert len(new) == max_new_tokens
    return new


def hf_logits(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len(token_ids), vocab]`` of one full forward pass."""
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float()


def greedy(max_tokens: int = 16, **kwargs: Any):
    """Greedy SamplingParams that never stop at eos, so a run yields exactly ``max_tokens``."""
    from engine.config import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def random_prompt(seed: int, num_tokens: int) -> list[int]:
    # Ids above the special tokens, so eos never appears in a prompt by accident.
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, VOCAB_SIZE, (num_tokens,), generator=gen).tolist()


def full_prompt_logits(runner, allocator, token_ids: list[int]) -> torch.Tensor:
    """Our logits for EVERY position of ``token_ids``: one hand-built prefill batch.

    Blocks come from ``allocator`` and are given back afterwards, so the runner's pool may be
    shared with a live engine.
    """
    from engine.config import SamplingParams
    from engine.scheduler import ScheduledBatch
    from engine.sequence import Sequence

    seq = Sequence("full-logits", list(token_ids), SamplingParams())
    seq.block_ids = allocator.allocate(-(-len(token_ids) // allocator.block_size))
    try:
        inputs = runner.prepare(ScheduledBatch(prefills=[(seq, len(token_ids))]))
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
            return runner.model.compute_logits(hidden)
    finally:
        allocator.free(seq.block_ids[::-1])


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm())
