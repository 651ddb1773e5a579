"""Mixture-of-experts models from GGUF files (engine/loader.py, engine/model_source.py and the GGUF
part of engine/models/arch.py): Qwen3-MoE (``qwen3moe``) and Mixtral (``llama`` with an expert
count), stacked expert tensors and the pre-2024 one-tensor-per-expert Mixtral layout, float32
and quantized experts, broken files, and `tandem plan`.

The files are the tiny transformers-made checkpoints of tests/models.py written by
tests/engine/gguf_writer.py in llama.cpp's layout, with SmolLM2's tokenizer.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.gguf_file import GGUFFile, read_gguf_metadata
from engine.loader import Checkpoint
from engine.model_errors import ModelFileError
from engine.model_source import ModelSource, load_arch, resolve_model
from engine.models.arch import MoEConfig
from tests.engine.gguf_writer import write_gguf
from tests.models import full_prompt_logits, hf_greedy, hf_logits, random_prompt, rel_error

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
# Against transformers' float32 forward on the same weights (those the file holds, for the
# quantized file); the safetensors bound of test_moe.py. Measured over five 37-token prompts:
# Qwen3-MoE at most 8.6e-7, Mixtral 1.3e-6, the quantized Qwen3-MoE 7.7e-7 (1.6e-1 to 2.1e-1
# from the unquantized model); the GGUF and safetensors loads were bit-identical. Experts'
# gate and up swapped gave 0.83-0.86, routing weights left unrenormalised 0.17-0.36.
LOGITS_REL_TOL = 1e-5
# Experts in three types, attention and embeddings in Q8_0: a Q4_K_M-like mix the gguf package
# can write (it cannot quantize to K-quants).
MIXED_QTYPES = {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_1, "ffn_down_exps": Q.Q4_0, "attn_q": Q.Q8_0,
                "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q8_0, "token_embd": Q.Q8_0, "output": Q.Q8_0}


@pytest.fixture(scope="module")
def tokenizer_metadata(smollm2_gguf) -> dict:
    return {k: v for k, v in read_gguf_metadata(smollm2_gguf).items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory, tiny_model_dir, tokenizer_metadata) -> Callable[..., tuple[Path, dict]]:
    """``moe_gguf(name, **writer_options)`` -> (GGUF path, values of the quantized tensors)."""
    built: dict[str, tuple[Path, dict]] = {}

    def build(name: str, **options) -> tuple[Path, dict]:
        key = f"{name}-{sorted(options.items())}"
        if key not in built:
            path = tmp_path_factory.mktemp(f"gguf-{name}") / f"{name}.gguf"
            built[key] = path, write_gguf(tiny_model_dir(name), path, tokenizer_metadata, **options)
        return built[key]

    return build


def _broken(tmp_path, tiny_model_dir, tokenizer_metadata, name: str, **options) -> Path:
    path = tmp_path / f"{name}.gguf"
    write_gguf(tiny_model_dir(name), path, tokenizer_metadata, **options)
    return path


# -- architecture -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, gguf_arch, moe_config", [
    ("qwen3_moe", "qwen3moe", MoEConfig(8, 2, 32, True)),
    ("mixtral", "llama", MoEConfig(4, 2, 32, True)),
])
def test_gguf_moe_arch_equals_the_safetensors_one(moe_gguf, tiny_model_dir, hf_model, name, gguf_arch, moe_config):
    path, _ = moe_gguf(name)
    assert GGUFFile(path).metadata["general.architecture"] == gguf_arch
    arch = load_arch(ModelSource("gguf", path))
    hf_arch = load_arch(resolve_model(str(tiny_model_dir(name))))
    assert arch.rms_norm_eps == float(np.float32(hf_arch.rms_norm_eps))   # GGUF stores it as float32
    assert arch == dataclasses.replace(hf_arch, rms_norm_eps=arch.rms_norm_eps)
    assert arch.moe == moe_config
    # Every tensor of the file is a parameter: the count covers each expert once.
    assert arch.num_params == sum(int(np.prod(t.shape)) for t in GGUFFile(path).tensors)
    assert arch.num_params == sum(p.numel() for p in hf_model(name).parameters())


def test_plan_counts_every_expert_of_a_gguf_moe(moe_gguf):
    path, _ = moe_gguf("qwen3_moe")
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "plan", "--json", "--model", str(path),
                           "--dtype", "float32", "--kv-cache-memory", "64MiB"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    d, f, vocab, layers = 64, 32, 49152, 2
    attn = d * 16 * (2 * 4 + 2 * 2) + 2 * 16           # q/o 4 heads, k/v 2 heads of 16, q/k norms
    sparse = 8 * 3 * d * f + 8 * d                      # 8 gated experts and the router
    params = layers * (attn + sparse + 2 * d) + 2 * vocab * d + d
    assert (plan["architecture"], plan["num_params"]) == ("Qwen3MoeForCausalLM", params)
    assert plan["num_active_params"] == params - layers * (8 - 2) * 3 * d * f
    assert plan["weight_bytes_per_gpu"] == params * 4


# -- logits and greedy tokens -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_gguf_moe_logits_equal_the_safetensors_load_and_transformers(moe_gguf, tiny_model_dir, hf_model,
                                                                       make_llm, name):
    path, _ = moe_gguf(name)
    prompt = random_prompt(seed=31, num_tokens=37)
    from_gguf = make_llm(path)
    ours = full_prompt_logits(from_gguf.engine.runner, from_gguf.engine.allocator, prompt)
    st = make_llm(tiny_model_dir(name))
    # float32 tensors hold the same values and q/k rows go back to the HF order exactly, so the
    # two loads compute the same thing bit for bit.
    assert torch.equal(ours, full_prompt_logits(st.engine.runner, st.engine.allocator, prompt))
    ref = hf_logits(hf_model(name), prompt)
    assert rel_error(ours, ref) < LOGITS_REL_TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_gguf_moe_greedy_tokens_match_transformers(moe_gguf, hf_model, make_llm, name):
    from engine.config import SamplingParams

    path, _ = moe_gguf(name)
    llm = make_llm(path)
    prompts = [random_prompt(seed=32 + i, num_tokens=n) for i, n in enumerate((21, 5, 40))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf_model(name), p, 12) for p in prompts]


def test_pre_2024_mixtral_files_with_one_tensor_per_expert(moe_gguf, make_llm):
    split, _ = moe_gguf("mixtral", split_experts=True)
    names = {t.name for t in GGUFFile(split).tensors}
    assert {"blk.1.ffn_gate.3.weight", "blk.1.ffn_down.0.weight"} <= names
    assert not any("_exps" in n for n in names)
    stacked, _ = moe_gguf("mixtral")
    prompt = random_prompt(seed=33, num_tokens=19)
    logits = []
    for path in (split, stacked):
        llm = make_llm(path)
        logits.append(full_prompt_logits(llm.engine.runner, llm.engine.allocator, prompt))
    assert torch.equal(logits[0], logits[1])


def test_quantized_experts_are_dequantized_to_the_values_the_file_holds(moe_gguf, tiny_model_dir, hf_model,
                                                                      make_llm, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path, stored = moe_gguf("qwen3_moe", qtypes=MIXED_QTYPES)
    types = {t.name: Q(t.tensor_type).name for t in GGUFFile(path).tensors}
    assert (types["blk.0.ffn_gate_exps.weight"], types["blk.0.ffn_up_exps.weight"],
            types["blk.0.ffn_down_exps.weight"], types["blk.0.ffn_gate_inp.weight"],
            types["blk.0.attn_q.weight"]) == ("Q8_0", "Q4_1", "Q4_0", "F32", "Q8_0")
    # The reference: transformers on the checkpoint with every quantized tensor replaced by the
    # values the file holds (quantized and dequantized by the gguf package).
    shutil.copytree(tiny_model_dir("qwen3_moe"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in stored and set(stored) <= set(tensors)
    save_file({**tensors, **stored}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with torch.inference_mode():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = random_prompt(seed=34, num_tokens=37)
    ref = hf_logits(hf, prompt)
    llm = make_llm(path)
    ours = full_prompt_logits(llm.engine.runner, llm.engine.allocator, prompt)
    assert rel_error(ours, ref) < LOGITS_REL_TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert rel_error(ours, hf_logits(hf_model("qwen3_moe"), prompt)) > 1e-3   # the quantization is real


def test_the_quantized_kernel_blocks_of_an_moe_file_are_not_kept(moe_gguf):
    # MoEForCausalLM attaches no GGUF blocks, so serve's memory check must not count them.
    path, _ = moe_gguf("qwen3_moe", qtypes=MIXED_QTYPES)
    assert GGUFFile(path).kernel_tensors()
    assert GGUFFile(path).kernel_block_bytes() == 0
    assert Checkpoint(ModelSource("gguf", path)).quantized_weights() == {}


# -- broken files -------------------------------------------------------------------------------

def _drop(target: str):
    return lambda name, values: None if name == target else values


def _swap_last_dims(target: str):
    return lambda name, values: np.ascontiguousarray(values.swapaxes(-1, -2)) if name == target else values


@pytest.mark.parametrize("name, options, field, problem", [
    ("qwen3_moe", {"edit": _drop("blk.1.ffn_up_exps.weight")}, "tensor 'blk.1.ffn_up_exps.weight'",
     "missing (8 experts of 32 features over a hidden size of 64, from the header)"),
    ("mixtral", {"edit": _swap_last_dims("blk.0.ffn_down_exps.weight")}, "tensor 'blk.0.ffn_down_exps.weight'",
     "shape (4, 32, 64), expected (4, 64, 32) (4 experts of 32 features over a hidden size of 64, from the header)"),
    ("qwen3_moe", {"edit": _drop("blk.0.ffn_gate_inp.weight")}, "tensor 'blk.0.ffn_gate_inp.weight'", "missing"),
    ("mixtral", {"split_experts": True, "edit": _drop("blk.1.ffn_gate.2.weight")}, "tensor 'blk.1.ffn_gate.2.weight'",
     "missing"),
    ("qwen3_moe", {"omit_keys": ("qwen3moe.expert_feed_forward_length",)}, "tensor 'blk.0.ffn_gate_exps.weight'",
     "shape (8, 32, 64), expected (8, 64, 64)"),   # llama.cpp's fallback: feed_forward_length 128 / top 2
    ("mixtral", {"omit_keys": ("llama.expert_count",)}, "metadata llama.expert_count",
     "missing or 0, but the file holds expert tensors (blk.0.ffn_gate_inp.weight)"),
    ("qwen3_moe", {"omit_keys": ("qwen3moe.expert_count",)}, "architecture",
     "GGUF metadata lacks qwen3moe.expert_count"),
])
def test_a_broken_moe_file_names_the_tensor_or_key(tmp_path, tiny_model_dir, tokenizer_metadata, name, options,
                                                    field, problem):
    path = _broken(tmp_path, tiny_model_dir, tokenizer_metadata, name, **options)
    with pytest.raises(ModelFileError, match=re.escape(f"{path} is not a valid GGUF file: {field}: ")) as info:
        Checkpoint(ModelSource("gguf", path))
    assert problem in str(info.value)


def test_the_engine_refuses_a_broken_moe_file_before_building_the_model(tmp_path, tiny_model_dir,
                                                                         tokenizer_metadata, make_llm):
    path = _broken(tmp_path, tiny_model_dir, tokenizer_metadata, "mixtral",
                   edit=_drop("blk.1.ffn_gate_exps.weight"))
    with pytest.raises(ValueError, match=re.escape(f"{path} is not a valid GGUF file: tensor "
                                                   "'blk.1.ffn_gate_exps.weight': missing")):
        make_llm(path)
