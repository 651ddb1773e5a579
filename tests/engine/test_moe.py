"""Tests for engine/models/moe.py (and the MoE parts of arch.py): routing, grouped experts, and
tiny random-weight Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints against transformers in float32.

The checkpoints are made by transformers' own config and model classes and saved as safetensors
(``tests/models.py``: TINY_MOE_SPECS); P/D and TP equality for them are in
tests/workers/test_pd_twin.py and test_tensor_parallel.py beside the dense models'.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import SamplingParams
from engine.loader import Checkpoint, resolve_model
from engine.models import moe
from engine.models.arch import SUPPORTED_ARCHITECTURES, MoEConfig
from engine.models.layers import TensorParallel
from engine.models.llama import check_tensor_parallel
from tests.models import TINY_MOE_ARCHS, full_prompt_logits, hf_greedy, hf_logits, random_prompt, rel_error

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# float32 against transformers' float32 forward: at most 1.5e-6 relative error measured over five
# 37-token prompts on each of these checkpoints (the dense models': 1.4e-6; same bound).
LOGITS_REL_TOL = 1e-5


# -- architecture ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, architecture, moe_config, dense_mlp", [
    ("qwen3_moe", "Qwen3MoeForCausalLM", MoEConfig(8, 2, 32, True), ()),
    ("qwen3_moe_step2", "Qwen3MoeForCausalLM", MoEConfig(8, 3, 32, False, dense_layers=(0,)), (0,)),
    ("mixtral", "MixtralForCausalLM", MoEConfig(4, 2, 32, True), ()),
    ("qwen2_moe", "Qwen2MoeForCausalLM", MoEConfig(8, 3, 32, False, 48, (1,)), (1,)),
])
def test_moe_arch_from_transformers_config(tiny_model_dir, hf_model, name, architecture, moe_config, dense_mlp):
    arch = Checkpoint(resolve_model(str(tiny_model_dir(name)))).arch
    assert architecture in SUPPORTED_ARCHITECTURES
    assert (arch.architecture, arch.moe) == (architecture, moe_config)
    assert arch.qk_norm == architecture.startswith("Qwen3")
    assert arch.attention_bias == (architecture == "Qwen2MoeForCausalLM")
    hf = hf_model(name)
    # Every parameter transformers holds is counted, each expert included, once.
    assert arch.num_params == sum(p.numel() for p in hf.parameters())
    hf_dense = tuple(i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "experts"))
    assert hf_dense == dense_mlp


def test_active_params_count_the_routed_experts_only(tiny_model_dir):
    arch = Checkpoint(resolve_model(str(tiny_model_dir("qwen3_moe")))).arch
    d, f = 64, 32
    unrouted = 2 * (8 - 2) * 3 * d * f     # 2 layers, 6 of 8 experts idle per token
    assert arch.num_params - arch.num_active_params == unrouted


def test_tp_size_must_divide_the_expert_features(tiny_model_dir, make_llm):
    arch = Checkpoint(resolve_model(str(tiny_model_dir("qwen2_moe")))).arch
    check_tensor_parallel(arch, 2)
    with pytest.raises(ValueError) as info:
        make_llm(tiny_model_dir("qwen2_moe"), tensor_parallel_size=3)
    assert str(info.value) == ("tensor_parallel_size=3 does not divide the model's 2 KV heads (and 4 attention "
                               "heads, intermediate_size 128, moe_intermediate_size 32, "
                               "shared_expert_intermediate_size 48); use --tensor-parallel-size 1 or 2")


# -- routing and grouped experts --------------------------------------------------------------

def test_route_softmax_over_all_then_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.5, 4.0, 1.0]])
    weights, ids = moe.route(logits, top_k=2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[1, 2], [2, 3]]
    assert torch.equal(weights, probs.gather(1, ids))
    assert weights.sum(-1).max() < 0.95    # the other experts' mass is not given back


def test_route_renormalized_is_a_softmax_over_the_chosen_logits():
    # Mixtral's rule (and Qwen's norm_topk_prob): weights sum to 1 over the k chosen experts.
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.5, 4.0, 1.0]])
    weights, ids = moe.route(logits, top_k=2, renormalize=True)
    assert ids.tolist() == [[1, 2], [2, 3]]
    expected = torch.softmax(logits.gather(1, ids), dim=-1)
    assert torch.allclose(weights, expected, rtol=0, atol=1e-7)
    assert weights.dtype == torch.float32


def test_experts_are_one_matmul_pair_per_expert_hit_not_per_token(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    experts = moe.Experts(num_experts=6, hidden=8, intermediate=4, tp=TensorParallel())
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen))
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen))
    x = torch.randn(10, 8, generator=gen)
    expert_ids = torch.tensor([[0, 3], [3, 5], [5, 0], [3, 0]] * 2 + [[0, 5], [5, 3]])   # experts 1, 2, 4 idle
    weights = torch.rand(10, 2, generator=gen)
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(moe.F, "linear", lambda a, w: calls.append(a.shape[0]) or linear(a, w))
    out = experts(x, weights, expert_ids)
    assert sorted(calls) == [6, 6, 7, 7, 7, 7]   # experts 0, 3, 5: 7, 6 and 7 rows, gate/up then down
    monkeypatch.setattr(moe.F, "linear", linear)

    def expert(e: int, row: torch.Tensor) -> torch.Tensor:
        gate, up = (experts.w13[e] @ row).chunk(2)
        return experts.w2[e] @ (torch.nn.functional.silu(gate) * up)

    expected = torch.stack([sum(w * expert(int(e), row) for w, e in zip(ws, es))
                            for row, ws, es in zip(x, weights, expert_ids)])
    assert out.dtype == torch.float32
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)


# -- tiny checkpoints vs transformers -----------------------------------------------------------

@pytest.mark.parametrize("name", TINY_MOE_ARCHS)
def test_moe_prompt_logits_match_transformers(tiny_model_dir, hf_model, make_llm, name):
    llm = make_llm(tiny_model_dir(name))
    prompt = random_prompt(seed=21, num_tokens=37)
    ours = full_prompt_logits(llm.engine.runner, llm.engine.allocator, prompt)
    ref = hf_logits(hf_model(name), prompt)
    assert ours.shape == ref.shape == (37, 49152)
    assert rel_error(ours, ref) < LOGITS_REL_TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", TINY_MOE_ARCHS)
def test_moe_greedy_tokens_match_transformers(tiny_model_dir, hf_model, make_llm, name):
    llm = make_llm(tiny_model_dir(name))
    prompts = [random_prompt(seed=22 + i, num_tokens=n) for i, n in enumerate((21, 5, 40))]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, greedy)   # one batch: decode steps route several tokens at once
    assert [o.token_ids for o in outs] == [hf_greedy(hf_model(name), p, 12) for p in prompts]


def test_the_router_matters(tiny_model_dir, hf_model, make_llm, tmp_path):
    # The logits comparison only means something if routing the tokens elsewhere is caught:
    # the same checkpoint with layer 0's router rows reversed must disagree with transformers.
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model_dir("qwen3_moe"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.gate.weight"] = tensors["model.layers.0.mlp.gate.weight"].flip(0).contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    prompt = random_prompt(seed=21, num_tokens=37)
    llm = make_llm(tmp_path)
    ours = full_prompt_logits(llm.engine.runner, llm.engine.allocator, prompt)
    assert rel_error(ours, hf_logits(hf_model("qwen3_moe"), prompt)) > 0.1


def test_a_missing_expert_tensor_is_named(tiny_model_dir, make_llm, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model_dir("mixtral"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="checkpoint lacks layer 1's expert 2 up projection"):
        make_llm(tmp_path)


def test_an_expert_beyond_num_experts_is_refused(tiny_model_dir, make_llm, tmp_path):
    shutil.copytree(tiny_model_dir("mixtral"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": 3}))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.block_sparse_moe\.experts\.3\.w1\.weight' has no "
                                         r"place in MixtralForCausalLM \(3 experts"):
        make_llm(tmp_path)


def test_the_simulated_engine_takes_an_moe_model_as_its_tokenizer_model(tiny_model_dir):
    # sim_arch cuts the model to one layer; Qwen2-MoE's dense layer 1 is then simply not there.
    from engine.sim.arch import sim_arch

    arch = sim_arch(Checkpoint(resolve_model(str(tiny_model_dir("qwen2_moe")))).arch)
    assert arch.num_layers == 1 and arch.moe is not None and arch.moe.is_sparse(0)
