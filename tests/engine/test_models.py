"""Tests for engine/models (arch.py, layers.py, llama.py) run through engine/model_runner.py.

transformers is the reference: the same checkpoint directory is loaded by ``LLM`` and by
``AutoModelForCausalLM`` in float32, and both the logits of every prompt position and the
greedy continuation must agree, for every supported architecture and for the embedded
SmolLM2-135M-Instruct GGUF (dequantized weights loaded into transformers' LlamaForCausalLM).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import SamplingParams
from engine.loader import Checkpoint, resolve_model
from engine.models.arch import SUPPORTED_ARCHITECTURES
from tests.models import (
    LLAMA3_ROPE,
    SMOLLM2,
    TINY_ARCHS,
    full_prompt_logits,
    hf_greedy,
    hf_logits,
    random_prompt,
    rel_error,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY_16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


# -- architecture parsing ----------------------------------------------------------------------

@pytest.mark.parametrize("name, architecture, tied, bias, qk_norm", [
    ("llama", "LlamaForCausalLM", False, False, False),
    ("llama_tied", "LlamaForCausalLM", True, False, False),
    ("llama3_rope", "LlamaForCausalLM", True, False, False),
    ("mistral", "MistralForCausalLM", False, False, False),
    ("qwen2", "Qwen2ForCausalLM", True, True, False),
    ("qwen3", "Qwen3ForCausalLM", False, False, True),
])
def test_arch_from_transformers_config(tiny_model_dir, name, architecture, tied, bias, qk_norm):
    arch = Checkpoint(resolve_model(str(tiny_model_dir(name)))).arch
    assert arch.architecture == architecture
    assert architecture in SUPPORTED_ARCHITECTURES
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers) == (49152, 64, 128, 2)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    assert (arch.tie_word_embeddings, arch.attention_bias, arch.qk_norm) == (tied, bias, qk_norm)
    assert arch.rope_theta == 10000.0
    assert arch.max_position_embeddings == 256
    assert arch.eos_token_ids == (2,)
    assert arch.rope_scaling == (LLAMA3_ROPE if name == "llama3_rope" else None)


# -- tiny random checkpoints vs transformers ---------------------------------------------------

# float32 logits against transformers' float32 forward: at most 1.4e-6 relative error measured on
# the tiny checkpoints and 3e-6 on SmolLM2 (Q4_1 weights dequantized for both sides).
LOGITS_REL_TOL = 1e-5

@pytest.mark.parametrize("name", TINY_ARCHS)
def test_prompt_logits_match_transformers(tiny_model_dir, hf_model, make_llm, name):
    llm = make_llm(tiny_model_dir(name))
    prompt = random_prompt(seed=11, num_tokens=37)  # 3 blocks, the last one partial
    ours = full_prompt_logits(llm.engine.runner, llm.engine.allocator, prompt)
    ref = hf_logits(hf_model(name), prompt)
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape == (37, 49152)
    assert rel_error(ours, ref) < LOGITS_REL_TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert llm.engine.allocator.num_used_blocks == 0


@pytest.mark.parametrize("name", TINY_ARCHS)
def test_greedy_tokens_match_transformers(tiny_model_dir, hf_model, make_llm, name):
    llm = make_llm(tiny_model_dir(name))
    prompt = random_prompt(seed=12, num_tokens=21)
    [out] = llm.generate(prompt, GREEDY_16)
    assert out.token_ids == hf_greedy(hf_model(name), prompt, 16)
    assert out.finish_reason == "length"


def test_llama3_rope_scaling_past_original_context(tiny_model_dir, hf_model, make_llm):
    # 100 prompt tokens + 16 generated, past original_max_position_embeddings=64, where the
    # llama3 rule divides the low frequencies by `factor`.
    llm = make_llm(tiny_model_dir("llama3_rope"), max_model_len=256)
    hf = hf_model("llama3_rope")
    prompt = random_prompt(seed=13, num_tokens=100)
    ours = full_prompt_logits(llm.engine.runner, llm.engine.allocator, prompt)
    assert rel_error(ours, hf_logits(hf, prompt)) < LOGITS_REL_TOL
    [out] = llm.generate(prompt, GREEDY_16)
    assert out.token_ids == hf_greedy(hf, prompt, 16)


def test_llama3_rope_scaling_is_not_a_no_op(tiny_model_dir, hf_model, make_llm, tmp_path):
    # The comparison above only means something if dropping the scaling would be caught: the
    # same weights with default rope must give clearly different logits.
    source = tiny_model_dir("llama3_rope")
    for file in source.iterdir():
        shutil.copy(file, tmp_path / file.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = make_llm(tmp_path, max_model_len=256)
    assert llm.engine.runner.arch.rope_scaling is None
    prompt = random_prompt(seed=13, num_tokens=100)
    unscaled = full_prompt_logits(llm.engine.runner, llm.engine.allocator, prompt)
    assert rel_error(unscaled, hf_logits(hf_model("llama3_rope"), prompt)) > 1e-2


# -- SmolLM2-135M-Instruct (the embedded GGUF) -------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_llm(smollm2_gguf):
    from engine.llm import LLM

    llm = LLM(SMOLLM2, dtype="float32", device="cpu", max_model_len=512, num_gpu_blocks_override=40)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_gguf):
    """transformers' LlamaForCausalLM holding the GGUF's dequantized weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    checkpoint = Checkpoint(resolve_model(SMOLLM2))
    arch = checkpoint.arch
    assert arch.tie_word_embeddings and arch.rope_scaling is None
    config = LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=arch.bos_token_id, eos_token_id=arch.eos_token_ids[0])
    with no_init_weights():
        hf = LlamaForCausalLM(config)
    state = {(name if name.startswith("lm_head.") else f"model.{name}"): tensor
             for name, tensor in checkpoint.weights()}
    result = hf.load_state_dict(state, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    hf.tie_weights()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf.float().eval()


def test_smollm2_greedy_chat_matches_transformers(smollm2_llm, smollm2_hf):
    [out] = smollm2_llm.chat([FRANCE], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    prompt = smollm2_llm.tokenizer.encode_chat(FRANCE)
    assert out.prompt_token_ids == prompt
    assert out.token_ids == hf_greedy(smollm2_hf, prompt, 32)
    assert out.text.startswith("The capital of France is Paris.")
    assert out.finish_reason == "length"
    assert smollm2_llm.engine.allocator.num_used_blocks == 0


def test_smollm2_prompt_logits_match_transformers(smollm2_llm, smollm2_hf):
    prompt = smollm2_llm.tokenizer.encode_chat(FRANCE)
    ours = full_prompt_logits(smollm2_llm.engine.runner, smollm2_llm.engine.allocator, prompt)
    assert rel_error(ours, hf_logits(smollm2_hf, prompt)) < 3 * LOGITS_REL_TOL


BF16_PROMPTS = [FRANCE, [{"role": "user", "content": "Write a haiku about the sea."}],
                [{"role": "user", "content": "List three prime numbers."}],
                [{"role": "user", "content": "Why is the sky blue?"}],
                [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
                [{"role": "user", "content": "What does a CPU do?"}]]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_smollm2_bfloat16_agrees_with_transformers(smollm2_gguf, smollm2_hf):
    """The CPU fast path (bf16 weights, oneDNN pre-packed linears, float32 residual stream,
    exact float32 rescoring of near-tied logits) against transformers on the same weights.

    Two bf16 implementations round differently, so free-running greedy text parts after the
    first near tie and a prefix count mostly measures where the ties fall. The stable measure is
    teacher-forced: along transformers' float32 greedy continuation of each prompt, how often
    the argmax of each position's logits equals float32's. Ours in bf16 must do at least as well
    as transformers in bf16, and France must be answered. Measured (6 prompts x 24 tokens, 144
    positions): ours bf16 143/144, transformers bf16 141/144.
    """
    import copy

    from engine.llm import LLM

    hf16 = copy.deepcopy(smollm2_hf).to(torch.bfloat16)
    llm = LLM(SMOLLM2, dtype="bfloat16", device="cpu", max_model_len=512, num_gpu_blocks_override=64)
    try:
        [france] = llm.chat([FRANCE], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        ours_hits = hf_hits = 0
        for messages in BF16_PROMPTS:
            prompt = llm.tokenizer.encode_chat(messages)
            ref = hf_greedy(smollm2_hf, prompt, 24)
            seq = prompt + ref
            n = len(prompt) - 1
            want = hf_logits(smollm2_hf, seq)[n:n + 24].argmax(-1)
            assert want.tolist() == ref
            ours = full_prompt_logits(llm.engine.runner, llm.engine.allocator, seq)[n:n + 24].argmax(-1)
            ours_hits += int((ours == want).sum())
            hf_hits += int((hf_logits(hf16, seq)[n:n + 24].argmax(-1) == want).sum())
    finally:
        llm.close()
    print(f"teacher-forced top-1 agreement with float32: ours bf16 {ours_hits}/144, transformers bf16 {hf_hits}/144")
    assert france.text.startswith("The capital of France is Paris.")
    assert ours_hits >= hf_hits, (ours_hits, hf_hits)
    assert ours_hits >= 140


def test_bfloat16_logits_rescoring_gives_the_float32_argmax(smollm2_gguf):
    """compute_logits on a bf16 model: the argmax equals that of logits computed in float32
    from the same bf16 hidden states and weights, on rows built to be near-ties."""
    from engine.llm import LLM

    llm = LLM(SMOLLM2, dtype="bfloat16", device="cpu", max_model_len=128, num_gpu_blocks_override=16)
    try:
        model = llm.engine.runner.model
        assert model.packed_head is not None
        weight = model.head_weight
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(64, weight.shape[1], generator=gen).to(torch.bfloat16)
        exact = hidden.float() @ weight.float().t()
        with torch.inference_mode():
            ours = model.compute_logits(hidden)
        assert torch.equal(ours.argmax(-1), exact.argmax(-1))
        top = exact.amax(-1)
        near = ours >= top[:, None] - top.abs()[:, None] * 2.0 ** -7
        assert torch.allclose(ours[near], exact[near], rtol=1e-5, atol=1e-5)
    finally:
        llm.close()
