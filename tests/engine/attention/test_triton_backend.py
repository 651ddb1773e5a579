"""The Triton kernels against the torch path: interpreted on the CPU, compiled on CUDA.

On the CPU the cases in kernel_checks run under TRITON_INTERPRET=1 in one child process, so the
interpreter never touches this process's Triton. On CUDA the same checks run at model shapes.
An sm_90 build of every kernel (no GPU needed) catches code the interpreter accepts but the
compiler rejects.
"""
from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import triton

from engine.attention import triton_backend
from tests.engine.attention import kernel_checks
from tests.triton_interpreter import interpret

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return interpret("tests.engine.attention.kernel_checks")


@pytest.mark.parametrize("case", list(kernel_checks.INTERPRETER_CASES))
def test_interpreted_kernel_matches_torch(interpreter_results, case):
    assert case in interpreter_results
    assert interpreter_results[case] is None, interpreter_results[case]


def test_import_touches_no_device():
    code = ("import torch, engine.attention.triton_backend; "
            "assert not torch.cuda.is_initialized(), 'CUDA initialized at import'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_rejects_block_size_that_is_not_a_power_of_two():
    cache = torch.zeros(2, 6, 1, 16)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        triton_backend.decode_attention(torch.zeros(1, 1, 16), cache, cache,
                                        torch.zeros(1, 2, dtype=torch.int32),
                                        torch.ones(1, dtype=torch.int32), 1, 0.25)


# ------------------------------------------------------------------------- sm_90 build, no GPU

_POINTER_DTYPES = {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
                   "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32",
                   "seq_lens_ptr": "*i32", "slot_mapping_ptr": "*i64"}


def _compile_sm90(kernel, dtype: str, num_warps: int = 4, **constexprs):
    """Build as the launcher would for contiguous tensors: unit last strides, 16-aligned rest."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(constexprs)
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs or (name.startswith("stride_") and name.endswith("d")):
            constexprs.setdefault(name, 1)
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _POINTER_DTYPES.get(name, "*" + dtype)
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    aligned = [(i,) for i, name in enumerate(kernel.arg_names)
               if name.endswith("_ptr") or name.startswith("stride_")]
    attrs = {key: [["tt.divisibility", 16]] for key in aligned
             if signature[kernel.arg_names[key[0]]] != "constexpr"}
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": 2})


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_build_for_sm90(dtype, head_dim):
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    precision = triton_backend._dot_precision(dtype)
    block_m, block_n, num_warps = triton_backend._prefill_tiles(head_dim, dtype)
    kernels = [
        _compile_sm90(triton_backend._write_kv_kernel, name, BLOCK_SIZE=16, HEAD_DIM=head_dim,
                      BLOCK_H=8),
        _compile_sm90(triton_backend._prefill_kernel, name, num_warps, BLOCK_SIZE=16,
                      HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
                      DOT_PRECISION=precision),
        _compile_sm90(triton_backend._decode_reduce_kernel, name, HEAD_DIM=head_dim,
                      BLOCK_SPLITS=8),
    ]
    block_n, num_warps = (32, 8) if dtype == torch.float32 else (64, 4)
    for split_k in (False, True):
        kernels.append(_compile_sm90(triton_backend._decode_kernel, name, num_warps, BLOCK_SIZE=16,
                                     HEAD_DIM=head_dim, BLOCK_H=16, BLOCK_N=block_n,
                                     SPLIT_K=split_k, DOT_PRECISION=precision))
    assert all(kernel.asm["cubin"] for kernel in kernels)


# ---------------------------------------------------------------------------- CUDA, model shapes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODELS = {
    "smollm2": dict(num_heads=9, num_kv_heads=3, head_dim=64),
    "llama8b": dict(num_heads=32, num_kv_heads=8, head_dim=128),
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _decode_lens(batch: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    fixed = [4096, 1, 16, 2048]  # longest, shortest, exact block multiples
    return (fixed + [rng.randint(1, 4096) for _ in range(batch)])[:batch]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_on_cuda(model, dtype, batch, num_splits):
    kernel_checks.check_decode("cuda", dtype, seq_lens=_decode_lens(batch, seed=batch),
                               block_size=16, num_splits=num_splits, seed=batch, **MODELS[model])


PREFILL_BATCHES = {
    "one_long": [(4096, 4096)],
    "mixed": [(512, 3000), (1, 17), (1000, 1000), (37, 4096), (129, 129)],
    "many_short": [(n, n + p) for n, p in zip(range(1, 65), range(64, 0, -1))],
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", PREFILL_BATCHES)
def test_prefill_on_cuda(model, dtype, batch):
    kernel_checks.check_prefill("cuda", dtype, chunks=PREFILL_BATCHES[batch], block_size=16,
                                **MODELS[model])
    kernel_checks.check_prefill("cuda", dtype, chunks=PREFILL_BATCHES[batch], block_size=16,
                                host_offsets=False, **MODELS[model])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key_dtype", [None, torch.float32])
def test_write_kv_on_cuda(model, dtype, key_dtype):
    shape = {k: v for k, v in MODELS[model].items() if k != "num_heads"}
    kernel_checks.check_write_kv("cuda", dtype, num_tokens=2048, block_size=16,
                                 key_dtype=key_dtype, **shape)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_empty_context_on_cuda(num_splits):
    kernel_checks.check_decode_empty_context("cuda", torch.bfloat16, num_splits=num_splits)


@pytest.mark.gpu
@needs_cuda
def test_attention_calls_do_not_wait_for_the_gpu():
    """The engine passes prefill offsets as host tuples. Making device tensors of them must not
    synchronize the stream: a blocking copy would make every layer wait for the GPU to drain
    and leave it idle while the host launches the next kernels."""
    from tests.engine.attention.paged import make_paged_kv

    gen = torch.Generator("cuda").manual_seed(0)
    chunks = [(30, 50), (7, 7)]
    paged = make_paged_kv(gen, [s for _, s in chunks], num_kv_heads=2, head_dim=64, block_size=16,
                          dtype=torch.bfloat16)
    query = torch.randn(37, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)
    kv = torch.randn(37, 2, 64, generator=gen, device="cuda").to(torch.bfloat16)
    slots = torch.arange(37, device="cuda")
    lens = torch.tensor([50, 7], dtype=torch.int32, device="cuda")

    def attention_calls():
        triton_backend.write_kv(kv, kv, paged.k_cache, paged.v_cache, slots)
        triton_backend.prefill_attention(query, paged.k_cache, paged.v_cache, paged.block_tables,
                                         (0, 30, 37), (50, 7), 0.125)
        triton_backend.decode_attention(query[:2], paged.k_cache, paged.v_cache, paged.block_tables,
                                        lens, 50, 0.125)

    attention_calls()  # compile outside the timed call
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time queued ahead
    started = time.perf_counter()
    attention_calls()
    elapsed_s = time.perf_counter() - started
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy and elapsed_s < 0.1, f"the calls took {elapsed_s:.3f} s: they waited for the GPU"
