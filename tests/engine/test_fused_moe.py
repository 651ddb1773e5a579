"""engine/models/fused_moe.py, the Triton MoE path: interpreted on the CPU, compiled on CUDA.

On the CPU the cases in fused_moe_checks run under TRITON_INTERPRET=1 in one child process (the
interpreter must be on before the kernels are wrapped), against the torch grouped path and
float64. An sm_90 build of both kernels (no GPU needed) catches code the interpreter accepts but
the compiler rejects. On CUDA the same checks run at Qwen3-MoE, Mixtral and Qwen2-MoE sizes, and
the whole sparse block is compared with transformers' own.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import triton

from engine.models import fused_moe, moe
from engine.models.layers import TensorParallel
from tests.engine import fused_moe_checks
from tests.triton_interpreter import interpret

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return interpret("tests.engine.fused_moe_checks")


@pytest.mark.parametrize("case", list(fused_moe_checks.INTERPRETER_CASES))
def test_interpreted_kernels_match_torch_and_float64(interpreter_results, case):
    assert case in interpreter_results
    assert interpreter_results[case] is None, interpreter_results[case]


def test_sort_pairs_pads_each_expert_to_whole_blocks():
    # Pairs 0..7 (token * 2 + slot) go to experts 0 3 3 5 5 0 3 0; experts 1, 2 and 4 are idle.
    expert_ids = torch.tensor([[0, 3], [3, 5], [5, 0], [3, 0]])
    sorted_pairs, block_experts = fused_moe.sort_pairs(expert_ids, num_experts=6, block_m=4)
    pad = 8   # num_pairs marks padding
    # cdiv(8 pairs, 4) + min(6 experts, 8 pairs) = 8 blocks of 4 rows, the last five unused.
    assert sorted_pairs.tolist() == [0, 5, 7, pad, 1, 2, 6, pad, 3, 4, pad, pad] + [pad] * 20
    assert block_experts.tolist() == [0, 3, 5, 6, 6, 6, 6, 6]   # 6 = num_experts: nothing to do
    assert (sorted_pairs.dtype, block_experts.dtype) == (torch.int32, torch.int32)


def test_tiles_follow_the_rows_per_expert():
    assert fused_moe.choose_tiles(8, 128, torch.bfloat16).block_m == 16       # one token, top-8
    assert fused_moe.choose_tiles(2048 * 8, 128, torch.bfloat16).block_m == 64
    assert fused_moe.choose_tiles(2048 * 8, 128, torch.float32).block_k == 32


def test_import_touches_no_device():
    code = ("import torch, engine.models.fused_moe; "
            "assert not torch.cuda.is_initialized(), 'CUDA initialized at import'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------------------------------------- sm_90 build, no GPU

_INT32_POINTERS = {"sorted_pairs_ptr", "block_experts_ptr"}
_FP32_POINTERS = {"weights_ptr", "out_ptr"}
_UNIT_STRIDES = {"stride_xk", "stride_wk", "stride_hn", "stride_hk", "stride_on"}


def _compile_sm90(kernel, dtype: str, tiles: fused_moe.Tiles, precision: str):
    """Build as the launcher would for contiguous tensors: unit last strides, 16-aligned rest."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
                  "DOT_PRECISION": precision,
                  **{name: 1 for name in _UNIT_STRIDES if name in kernel.arg_names}}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _INT32_POINTERS:
            signature[name] = "*i32"
        elif name in _FP32_POINTERS:
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*" + dtype
        else:
            signature[name] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if signature[name] != "constexpr" and (name.endswith("_ptr") or name.startswith("stride_"))}
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_pairs", [8, 2048 * 8])    # Qwen3-30B-A3B: one token, 2048 tokens
def test_kernels_build_for_sm90(dtype, num_pairs):
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    tiles = fused_moe.choose_tiles(num_pairs, 128, dtype)
    precision = fused_moe.dot_precision(dtype)
    kernels = [_compile_sm90(kernel, name, tiles, precision)
               for kernel in (fused_moe._gate_up_kernel, fused_moe._down_kernel)]
    assert all(kernel.asm["cubin"] for kernel in kernels)


# ---------------------------------------------------------------------------- CUDA, model sizes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOKEN_COUNTS = [1, 7, 64, 2048]
DTYPES = [torch.float32, torch.bfloat16]


def _expert_sizes(family: str) -> dict[str, int]:
    sizes = fused_moe_checks.FAMILIES[family][4]
    return dict(num_experts=sizes.get("num_experts") or sizes["num_local_experts"],
                top_k=sizes["num_experts_per_tok"], hidden=sizes["hidden_size"],
                intermediate=sizes.get("moe_intermediate_size") or sizes["intermediate_size"])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", fused_moe_checks.FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_fused_experts_on_cuda(family, dtype, num_tokens):
    errors = fused_moe_checks.check_fused_experts("cuda", dtype, num_tokens=num_tokens, seed=num_tokens,
                                                  **_expert_sizes(family))
    print(f"experts {family} {dtype} T={num_tokens}: triton {errors.triton:.2e} torch {errors.torch:.2e}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", fused_moe_checks.FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_block_on_cuda_matches_transformers(family, dtype):
    errors = fused_moe_checks.check_block_against_transformers("cuda", dtype, family, TOKEN_COUNTS)
    for num_tokens, err in errors.items():
        print(f"block {family} {dtype} T={num_tokens}: ours {err.ours:.2e} transformers {err.hf:.2e} "
              f"ours-vs-transformers {err.ours_vs_hf:.2e}")
        # Ours rounds once, at the block's output; transformers also rounds the routing weights
        # and sums the experts in the model dtype, so it is the less exact of the two.
        assert err.ours < fused_moe_checks.TOLERANCE[dtype], (num_tokens, err)
        assert err.ours_vs_hf < 3 * fused_moe_checks.TOLERANCE[dtype], (num_tokens, err)


@pytest.mark.gpu
@needs_cuda
def test_experts_on_cuda_take_the_fused_path(monkeypatch):
    experts = moe.Experts(num_experts=4, hidden=32, intermediate=16, tp=TensorParallel()).cuda()
    torch.nn.init.normal_(experts.w13)
    torch.nn.init.normal_(experts.w2)
    monkeypatch.setattr(moe, "grouped_experts", lambda *args: pytest.fail("torch path taken on CUDA"))
    x = torch.randn(5, 32, device="cuda")
    weights, expert_ids = moe.route(torch.randn(5, 4, device="cuda"), 2, True)
    assert experts(x, weights, expert_ids).shape == (5, 32)


@pytest.mark.gpu
@needs_cuda
def test_fused_experts_do_not_wait_for_the_gpu():
    """No expert count is read back: the call returns while earlier work is still queued (the
    torch path's ``bincount(...).tolist()`` would wait for it)."""
    sizes = _expert_sizes("qwen3_moe")
    gen = torch.Generator("cuda").manual_seed(0)
    w13, w2 = fused_moe_checks.random_experts(gen, sizes["num_experts"], sizes["hidden"],
                                              sizes["intermediate"], torch.bfloat16, "cuda")
    x = torch.randn(16, sizes["hidden"], device="cuda", dtype=torch.bfloat16)
    weights, expert_ids = moe.route(torch.randn(16, sizes["num_experts"], device="cuda"), sizes["top_k"], True)
    fused_moe.fused_experts(x, w13, w2, weights, expert_ids)   # compiles
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)    # about 0.5 s of queued GPU time
    start = time.perf_counter()
    fused_moe.fused_experts(x, w13, w2, weights, expert_ids)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    assert elapsed < 0.1, f"fused_experts held the host {elapsed:.3f} s behind queued GPU work"
