"""Tests for engine/loader.py and the engine's input validation: bad models and bad requests
must fail early with a ValueError / FileNotFoundError that names the file, the field or the
knob to change, never with a stray traceback from deep inside torch or safetensors.
"""
from __future__ import annotations

import json
import re
import shutil
import struct

import numpy as np
import pytest
import torch

from engine.config import SamplingParams
from engine.loader import Checkpoint, _unpermute_rope, resolve_model
from engine.models.arch import SUPPORTED_ARCHITECTURES
from tests.models import random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    """A private copy of the tiny Llama checkpoint that a test may break."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    return path


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _gguf_bytes(metadata: dict[str, str], version: int = 3) -> bytes:
    """A tensor-less GGUF file whose metadata values are all strings."""
    out = b"GGUF" + struct.pack("<IQQ", version, 0, len(metadata))
    for key, value in metadata.items():
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", 8)
        out += struct.pack("<Q", len(value)) + value.encode()
    return out


# -- finding the model --------------------------------------------------------------------------

def test_missing_model_path_is_named(make_llm, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        make_llm(missing)


def test_a_plain_file_that_is_not_gguf(make_llm, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*not a .gguf"):
        make_llm(path)


def test_resolve_model_kinds(tiny_model_dir, smollm2_gguf, tmp_path):
    assert resolve_model("smollm2-135m-instruct").kind == "gguf"
    assert resolve_model(str(tiny_model_dir("llama"))).kind == "hf"
    # A directory holding a single .gguf and no config.json is that GGUF.
    (tmp_path / "model.gguf").symlink_to(smollm2_gguf)
    assert resolve_model(str(tmp_path)).path == tmp_path / "model.gguf"


def test_directory_without_config_json(make_llm, tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "config.json"))):
        make_llm(tmp_path)


def test_corrupt_config_json(make_llm, model_copy):
    (model_copy / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ValueError, match=re.escape(str(model_copy / "config.json")) + " is not valid JSON"):
        make_llm(model_copy)


def test_unsupported_architecture_names_the_supported_ones(make_llm, model_copy):
    _edit_config(model_copy, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM") as info:
        make_llm(model_copy)
    assert all(name in str(info.value) for name in SUPPORTED_ARCHITECTURES)


def test_config_without_architectures(make_llm, model_copy):
    _edit_config(model_copy, architectures=[])
    with pytest.raises(ValueError, match="no 'architectures'"):
        make_llm(model_copy)


def test_unsupported_rope_scaling(make_llm, model_copy):
    _edit_config(model_copy, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        make_llm(model_copy)


def test_missing_tokenizer_json(make_llm, model_copy):
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(model_copy / "tokenizer.json"))):
        make_llm(model_copy)


# -- safetensors weights ------------------------------------------------------------------------

def test_config_but_no_safetensors(make_llm, model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"no *.safetensors files in {model_copy}")):
        make_llm(model_copy)


@pytest.mark.parametrize("keep", ["4 bytes", "100 bytes", "half", "all but one byte"])
def test_truncated_safetensors(make_llm, model_copy, keep):
    file = model_copy / "model.safetensors"
    size = file.stat().st_size
    keep_nbytes = {"4 bytes": 4, "100 bytes": 100, "half": size // 2, "all but one byte": size - 1}[keep]
    with open(file, "r+b") as handle:
        handle.truncate(keep_nbytes)
    with pytest.raises(ValueError, match=re.escape(str(file)) + " is not a valid safetensors file"):
        make_llm(model_copy)


def test_missing_and_misshapen_tensors(make_llm, model_copy):
    from safetensors.torch import load_file, save_file

    file = model_copy / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match=re.escape("checkpoint lacks layers.1.self_attn.qkv_proj.weight (shard 1)")):
        make_llm(model_copy)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)  # 1 kv head, not 2
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match=re.escape(
            "layers.1.self_attn.qkv_proj.weight has shape (112, 64), expected (128, 64)")):
        make_llm(model_copy)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 32)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match=re.escape(
            "shards of layers.1.self_attn.qkv_proj.weight have mismatched shapes [(64, 64), (32, 32), (32, 64)]")):
        make_llm(model_copy)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.0.self_attn.rotary.weight"] = torch.zeros(2)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="'layers.0.self_attn.rotary.weight' has no place"):
        make_llm(model_copy)


# -- GGUF files ---------------------------------------------------------------------------------

def _gguf_prefix(smollm2_gguf, path, nbytes: int):
    with open(smollm2_gguf, "rb") as source:
        path.write_bytes(source.read(nbytes))
    return path


@pytest.mark.parametrize("content", ["empty", "garbage", "header cut", "tensors cut", "version 1"])
def test_broken_gguf_is_a_value_error_naming_the_file(make_llm, smollm2_gguf, tmp_path, content):
    path = tmp_path / "model.gguf"
    if content == "empty":
        path.write_bytes(b"")
    elif content == "garbage":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif content == "header cut":     # inside the vocabulary
        _gguf_prefix(smollm2_gguf, path, 100_000)
    elif content == "tensors cut":    # whole header, token_embd (30 MB) runs past the end
        _gguf_prefix(smollm2_gguf, path, 8 << 20)
    else:
        path.write_bytes(_gguf_bytes({"general.architecture": "llama"}, version=1))
    with pytest.raises(ValueError, match=re.escape(str(path)) + " is not a valid GGUF file"):
        make_llm(path)


def test_gguf_of_an_unsupported_architecture(make_llm, tmp_path):
    path = tmp_path / "gpt2.gguf"
    path.write_bytes(_gguf_bytes({"general.architecture": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'") as info:
        make_llm(path)
    assert "LlamaForCausalLM" in str(info.value)


def test_unpermute_rope_inverts_llama_cpp_permute():
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        # convert_hf_to_gguf.py, LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    rng = np.random.default_rng(0)
    for n_head, head_dim, cols in [(4, 16, 64), (2, 16, 64), (9, 64, 576), (3, 8, 5)]:
        w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
        permuted = llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(_unpermute_rope(permuted, n_head), w)
    # Row r of head h: llama.cpp interleaves the two rotary halves (0, 8, 1, 9, ...).
    rows = np.arange(16, dtype=np.float32)[:, None]
    assert llama_cpp_permute(rows, 1)[:, 0].tolist() == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]
    assert _unpermute_rope(llama_cpp_permute(rows, 1), 1)[:, 0].tolist() == list(range(16))


def test_gguf_weights_get_hf_names_and_shapes(smollm2_gguf):
    checkpoint = Checkpoint(resolve_model("smollm2-135m-instruct"))
    shapes = {}
    for name, tensor in checkpoint.weights():
        if name.startswith(("layers.0.", "embed", "norm", "lm_head")):
            shapes[name] = tuple(tensor.shape)
            assert tensor.dtype == torch.float32
    assert shapes == {
        "embed_tokens.weight": (49152, 576), "norm.weight": (576,),
        "layers.0.input_layernorm.weight": (576,), "layers.0.post_attention_layernorm.weight": (576,),
        "layers.0.self_attn.q_proj.weight": (576, 576), "layers.0.self_attn.k_proj.weight": (192, 576),
        "layers.0.self_attn.v_proj.weight": (192, 576), "layers.0.self_attn.o_proj.weight": (576, 576),
        "layers.0.mlp.gate_proj.weight": (1536, 576), "layers.0.mlp.up_proj.weight": (1536, 576),
        "layers.0.mlp.down_proj.weight": (576, 1536),
    }


# -- requests -----------------------------------------------------------------------------------

@pytest.fixture
def llm(tiny_model_dir, make_llm):
    return make_llm(tiny_model_dir("llama"), max_model_len=32)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match=r"the prompt has 40 tokens, longer than max_model_len=32"):
        llm.generate(random_prompt(seed=0, num_tokens=40), SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("prompt", [[], ""])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate(prompt if prompt == "" else [prompt], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("bad", [49152, -1, 10**12])
def test_out_of_vocabulary_token_id(llm, bad):
    with pytest.raises(ValueError, match=re.escape(f"prompt token id {bad} is outside the vocabulary [0, 49152)")):
        llm.generate([5, 6, bad], SamplingParams(max_tokens=2))
    assert llm.engine.allocator.num_used_blocks == 0


def test_duplicate_request_id(llm):
    llm.engine.add_request("r", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id='r' is already running"):
        llm.engine.add_request("r", [5, 6], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("logprobs", 21), ("logprobs", -1), ("max_tokens", 0), ("top_k", -2), ("seed", -1),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must"):
        SamplingParams(**{field: value})


def test_sampling_params_count_must_match_prompts(llm):
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[5, 6]], [SamplingParams(), SamplingParams()])


def test_unknown_llm_option(tiny_model_dir, make_llm):
    with pytest.raises(TypeError, match="unknown option 'max_num_tokens'"):
        make_llm(tiny_model_dir("llama"), max_num_tokens=3)


def test_kv_pool_smaller_than_max_model_len(tiny_model_dir, make_llm):
    with pytest.raises(ValueError, match="less than one max_model_len=64 sequence") as info:
        make_llm(tiny_model_dir("llama"), max_model_len=64, num_gpu_blocks_override=3, block_size=16)
    message = str(info.value)
    assert "3 blocks x 16 tokens = 48 tokens" in message
    assert "max_model_len=64" in message
    assert "--num-gpu-blocks-override" in message and "--max-model-len" in message
    # Exactly one sequence's worth is enough.
    make_llm(tiny_model_dir("llama"), max_model_len=64, num_gpu_blocks_override=4, block_size=16)


def test_sliding_window_caps_or_refuses_max_model_len(make_llm, model_copy, caplog):
    # A Mistral checkpoint with a 16-token window: full attention is only right within it.
    _edit_config(model_copy, architectures=["MistralForCausalLM"], sliding_window=16, max_position_embeddings=128)
    with caplog.at_level("WARNING"):
        llm = make_llm(model_copy)
    assert llm.engine.max_model_len == 16
    assert "capping max_model_len at the model's sliding_window=16" in caplog.text
    with pytest.raises(ValueError, match="max_model_len=64 exceeds the model's sliding_window=16"):
        make_llm(model_copy, max_model_len=64)
    # Qwen-style configs name a window but only use it with use_sliding_window.
    _edit_config(model_copy, architectures=["Qwen2ForCausalLM"], use_sliding_window=False, attention_bias=False)
    assert make_llm(model_copy).engine.max_model_len == 128
