"""--load-format dummy: random weights of a checkpoint's shapes, read from its config alone.

What it is for: measuring a model's speed (a `benchmarks/engine.py --json` profile for the
simulator) on hardware that lacks its weights. What must hold: it runs from a directory with no
weight files, its weights are the documented distribution and the same for the same seed, a GGUF's
quantized blocks (which hold the real weights) are never attached, and a worker running them
never pairs with one running the checkpoint's weights.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from engine.config import ModelConfig
from engine.fingerprint import identity_of, model_identity, worker_fingerprint
from engine.models.layers import PackedLinear, RMSNorm
from engine.models.llama import DUMMY_SCALE
from router.registry import WorkerRegistry
from tests.models import greedy, random_prompt


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Llama's config and tokenizer files, without its safetensors."""
    root = tmp_path_factory.mktemp("config-only")
    for file in tiny_model_dir("llama").iterdir():
        if file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            shutil.copy(file, root / file.name)
    return root


def test_the_flag_is_checked():
    with pytest.raises(ValueError, match="load_format='random'"):
        ModelConfig(load_format="random")


def test_a_directory_without_weights_needs_dummy(config_only_dir, make_llm):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        make_llm(config_only_dir)


@pytest.fixture
def unpacked(monkeypatch):
    """Keep every linear an nn.Linear (no oneDNN packing), so its weight is a parameter to read."""
    monkeypatch.setattr("engine.model_runner.can_pack_linear", lambda device, dtype: False)


def test_dummy_weights_run_from_the_config_alone_and_repeat_with_the_seed(config_only_dir, make_llm, unpacked):
    prompt = random_prompt(seed=3, num_tokens=20)
    first = make_llm(config_only_dir, load_format="dummy")
    model = first.engine.runner.model
    assert any(name.endswith("down_proj.weight") for name, _ in model.named_parameters())
    for name, param in model.named_parameters():
        assert param.device.type == "cpu" and not param.is_meta, name
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, RMSNorm):
            assert param.dtype == torch.float32 and bool((param == 1).all()), name
        else:
            assert param.abs().max() <= DUMMY_SCALE and param.std() > DUMMY_SCALE / 4, name
    out = first.generate([prompt], greedy(8))[0].token_ids
    second = make_llm(config_only_dir, load_format="dummy")
    assert second.generate([prompt], greedy(8))[0].token_ids == out
    assert len(out) == 8


def test_dummy_never_reads_the_weights_a_checkpoint_holds(tiny_dir, make_llm, unpacked):
    real = make_llm(tiny_dir).engine.runner.model
    dummy = make_llm(tiny_dir, load_format="dummy").engine.runner.model
    weight = "layers.0.self_attn.o_proj.weight"
    assert real.get_parameter(weight).abs().max() > 10 * DUMMY_SCALE   # tests/models.py draws 0.2 * randn
    assert dummy.get_parameter(weight).abs().max() <= DUMMY_SCALE


def test_dummy_weights_of_a_gguf_attach_no_quantized_blocks(smollm2_gguf, make_llm):
    # The blocks are the file's real weights: attached beside random dense ones, decode steps
    # at small batches would read the real model and larger ones the random one.
    llm = make_llm(smollm2_gguf, load_format="dummy", dtype="bfloat16", max_model_len=64)
    packed = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert packed, "bf16 on CPU packs the linears"
    assert all(m.quant is None for m in packed)


def test_a_dummy_worker_pairs_only_with_dummy_workers_and_routers(config_only_dir, tiny_dir, make_llm):
    dummy = make_llm(tiny_dir, load_format="dummy").engine
    real = make_llm(tiny_dir).engine
    dummy_print, real_print = worker_fingerprint(dummy), worker_fingerprint(real)
    assert dummy_print.mismatch(real_print) == ["weights"]
    # A router given --load-format dummy computes the same identity from the model's files,
    # and from a directory of the same config without weight files.
    assert model_identity(str(tiny_dir), weights=False) == dummy_print.model
    assert model_identity(str(config_only_dir), weights=False) == dummy_print.model   # the name is a label
    assert model_identity(str(tiny_dir)) == real_print.model
    assert identity_of(real.model_source, real.arch, weights=False) == dummy_print.model
    # What the router checks workers against (`python -m router --load-format dummy`).
    assert WorkerRegistry(model=str(tiny_dir), dummy_weights=True)._own_identity() == dummy_print.model
    assert WorkerRegistry(model=str(tiny_dir))._own_identity() == real_print.model
