"""The Triton fused-MoE path against the torch grouped path and float64, on any device; a runner
for the Triton interpreter.

The same check runs at small shapes under ``TRITON_INTERPRET=1`` on the CPU and at model shapes
on CUDA. The interpreter must be on before ``triton.jit`` wraps the kernels, so
test_fused_moe.py runs the interpreted cases in a child process:
``TRITON_INTERPRET=1 python -m tests.engine.fused_moe_checks`` prints one JSON object, case name
-> error message or null.

The reference is ``moe.grouped_experts`` in float64 on the same (possibly 16-bit) values, with the
same routing, so the errors measure the expert arithmetic alone.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.models import fused_moe, moe
from engine.models.arch import arch_from_hf_config
from engine.models.layers import TensorParallel
from tests.triton_interpreter import report

# Relative error (Frobenius) against float64. Float32: both paths measured 1.1e-7 to 2.3e-7 on
# the interpreter's shapes; on an H100 at model sizes Triton 1.2e-6 to 2.8e-6 (one float32
# accumulator over the whole reduction, up to 14336 long) and cuBLAS 2.3e-7 to 2.1e-6. 16-bit:
# matmul outputs are rounded to the model dtype (bf16 keeps 8 bits, 2**-9 = 2e-3 relative; fp16
# 11); bf16 measured 2.7e-3 to 3.3e-3 for Triton and 3.1e-3 to 4.3e-3 for torch on the
# interpreter, 1.6e-3 to 1.7e-3 and 3.9e-3 to 4.8e-3 on the H100 (Triton rounds only the SiLU
# product; torch also gate, up and down); fp16 2.3e-4 and 4.7e-4 on the interpreter.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class Errors:
    triton: float   # fused_experts against float64
    torch: float    # grouped_experts in the same dtype against float64


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref).norm() / ref.norm()).item()


def random_experts(gen: torch.Generator, num_experts: int, hidden: int, intermediate: int,
                   dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13`` ``[E, 2f, hidden]`` and ``w2`` ``[E, hidden, f]`` scaled so gate, up and the output
    are O(1) for O(1) inputs."""
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen, device=device) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen, device=device) * intermediate ** -0.5
    return w13.to(dtype), w2.to(dtype)


def check_fused_experts(device: str, dtype: torch.dtype, *, num_tokens: int, num_experts: int,
                        top_k: int, hidden: int, intermediate: int,
                        tiles: fused_moe.Tiles | None = None, expert_ids: torch.Tensor | None = None,
                        strided_x: bool = False, seed: int = 0) -> Errors:
    """Random experts and routing (or ``expert_ids`` given); ``strided_x`` takes x as a column
    slice of a wider tensor, as a fused projection's output would be."""
    gen = torch.Generator(device).manual_seed(seed)
    w13, w2 = random_experts(gen, num_experts, hidden, intermediate, dtype, device)
    x = torch.randn(num_tokens, 2 * hidden if strided_x else hidden, generator=gen, device=device)
    x = x[:, :hidden].to(dtype) if strided_x else x.to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    weights, routed = moe.route(logits, top_k, renormalize=True)
    if expert_ids is None:
        expert_ids = routed
    expert_ids = expert_ids.to(device)

    ref = moe.grouped_experts(x.double(), w13.double(), w2.double(), weights.double(), expert_ids)
    ours = fused_moe.fused_experts(x, w13, w2, weights, expert_ids, tiles)
    torch_path = moe.grouped_experts(x, w13, w2, weights, expert_ids)
    assert ours.shape == (num_tokens, hidden) and ours.dtype == torch.float32, (ours.shape, ours.dtype)
    if num_tokens == 0:
        return Errors(0.0, 0.0)
    errors = Errors(rel_err(ours, ref), rel_err(torch_path, ref))
    assert errors.triton < TOLERANCE[dtype], f"Triton {errors.triton:.2e} (torch {errors.torch:.2e})"
    return errors


# -- the whole sparse block against transformers' -----------------------------------------------

# name -> (transformers config class, modeling module, sparse block class, architecture, the
# published model's sizes: Qwen3-30B-A3B, Mixtral-8x7B, Qwen1.5-MoE-A2.7B)
FAMILIES: dict[str, tuple[str, str, str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeForCausalLM",
                  dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                       norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "mixtral", "MixtralSparseMoeBlock", "MixtralForCausalLM",
                dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "qwen2_moe", "Qwen2MoeSparseMoeBlock", "Qwen2MoeForCausalLM",
                  dict(hidden_size=2048, moe_intermediate_size=1408, num_experts=60, num_experts_per_tok=4,
                       shared_expert_intermediate_size=5632, norm_topk_prob=False)),
}


@dataclass(frozen=True)
class BlockErrors:
    ours: float     # moe.SparseMoeBlock against float64
    hf: float       # transformers' sparse block against float64
    ours_vs_hf: float


def _ours_from_hf(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """transformers' block state (stacked ``experts.gate_up_proj`` as transformers 5 keeps it, or
    one module per expert as 4.x did) under ``moe.SparseMoeBlock``'s names."""
    ours = {"gate.weight": state["gate.weight"]}
    if "experts.gate_up_proj" in state:
        ours["experts.w13"], ours["experts.w2"] = state["experts.gate_up_proj"], state["experts.down_proj"]
    else:
        def part(e: int, *names: str) -> torch.Tensor:
            return next(state[f"experts.{e}.{n}.weight"] for n in names if f"experts.{e}.{n}.weight" in state)
        ours["experts.w13"] = torch.stack([torch.cat([part(e, "gate_proj", "w1"), part(e, "up_proj", "w3")])
                                           for e in range(num_experts)])
        ours["experts.w2"] = torch.stack([part(e, "down_proj", "w2") for e in range(num_experts)])
    if "shared_expert_gate.weight" in state:
        ours["shared_expert.gate_up_proj.weight"] = torch.cat([state["shared_expert.gate_proj.weight"],
                                                               state["shared_expert.up_proj.weight"]])
        ours["shared_expert.down_proj.weight"] = state["shared_expert.down_proj.weight"]
        ours["shared_expert_gate.weight"] = state["shared_expert_gate.weight"]
    return ours


def check_block_against_transformers(device: str, dtype: torch.dtype, family: str,
                                     token_counts: list[int], seed: int = 0) -> dict[int, BlockErrors]:
    """Random weights (each matrix scaled by its fan-in) in transformers' sparse block, copied into
    ``moe.SparseMoeBlock``; both run on the same inputs. The float64 reference takes our routing
    (the same logits as transformers', from the same matmul) and computes the experts and the
    shared expert in float64."""
    import importlib

    import transformers

    config_class, module, block_class, architecture, sizes = FAMILIES[family]
    hf_config = getattr(transformers, config_class)(architectures=[architecture], **sizes)
    arch = arch_from_hf_config(hf_config.to_dict())
    assert arch.moe is not None
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    gen = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        hf = getattr(modeling, block_class)(hf_config)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, device=device) * param.shape[-1] ** -0.5)
    hf = hf.to(dtype).eval()
    ours = moe.SparseMoeBlock(arch, arch.moe, TensorParallel()).to(device=device, dtype=dtype)
    ours.load_state_dict(_ours_from_hf(hf.state_dict(), arch.moe.num_experts))

    w13, w2 = ours.experts.w13.double(), ours.experts.w2.double()
    errors = {}
    with torch.no_grad():
        for num_tokens in token_counts:
            x = torch.randn(num_tokens, arch.hidden_size, generator=gen, device=device).to(dtype)
            hf_out = hf(x[None])
            hf_out = (hf_out[0] if isinstance(hf_out, tuple) else hf_out).reshape(num_tokens, -1)
            out = ours(x)
            weights, expert_ids = moe.route(ours.gate(x), arch.moe.top_k, arch.moe.norm_topk_prob)
            xd = x.double()
            ref = moe.grouped_experts(xd, w13, w2, weights.double(), expert_ids)
            if ours.shared_expert is not None and ours.shared_expert_gate is not None:
                gate, up = F.linear(xd, ours.shared_expert.gate_up_proj.weight.double()).chunk(2, dim=-1)
                shared = F.linear(F.silu(gate) * up, ours.shared_expert.down_proj.weight.double())
                ref += torch.sigmoid(F.linear(xd, ours.shared_expert_gate.weight.double())) * shared
            errors[num_tokens] = BlockErrors(rel_err(out, ref), rel_err(hf_out, ref),
                                             rel_err(out, hf_out.double()))
    return errors


_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16
_SMALL = dict(num_experts=8, top_k=2, hidden=64, intermediate=32)
# Every pair on expert 2, top-1: one segment of three 16-row blocks, the last one partly padding.
_ONE_EXPERT = torch.full((40, 1), 2)

INTERPRETER_CASES: dict[str, Callable[[], object]] = {
    "f32_one_token": lambda: check_fused_experts("cpu", _F32, num_tokens=1, **_SMALL),
    "f32_seven_tokens": lambda: check_fused_experts("cpu", _F32, num_tokens=7, **_SMALL),
    # Sizes that are no multiple of any tile, six experts, three per token.
    "f32_ragged_sizes": lambda: check_fused_experts("cpu", _F32, num_tokens=9, num_experts=6, top_k=3,
                                                    hidden=48, intermediate=40),
    # 16-row blocks where each of 4 experts holds ~20 pairs: segments of two blocks.
    "f32_segments_of_several_blocks": lambda: check_fused_experts(
        "cpu", _F32, num_tokens=40, num_experts=4, top_k=2, hidden=32, intermediate=24,
        tiles=fused_moe.Tiles(16, 16, 16, 4, 2)),
    "f32_all_on_one_expert": lambda: check_fused_experts(
        "cpu", _F32, num_tokens=40, num_experts=4, top_k=1, hidden=32, intermediate=16,
        expert_ids=_ONE_EXPERT, tiles=fused_moe.Tiles(16, 16, 16, 4, 2)),
    "f32_strided_x": lambda: check_fused_experts("cpu", _F32, num_tokens=5, strided_x=True, **_SMALL),
    "f32_no_tokens": lambda: check_fused_experts("cpu", _F32, num_tokens=0, **_SMALL),
    "bf16_seven_tokens": lambda: check_fused_experts("cpu", _BF16, num_tokens=7, **_SMALL),
    "bf16_block_m32": lambda: check_fused_experts(
        "cpu", _BF16, num_tokens=33, num_experts=4, top_k=2, hidden=64, intermediate=32,
        tiles=fused_moe.Tiles(32, 32, 32, 4, 2)),
    "f16_ragged_sizes": lambda: check_fused_experts("cpu", _F16, num_tokens=9, num_experts=6, top_k=3,
                                                    hidden=48, intermediate=40),
}


if __name__ == "__main__":
    report(INTERPRETER_CASES)
