"""Triton kernels against the torch path, on any device; a runner for the Triton interpreter.

The same checks run at small shapes under ``TRITON_INTERPRET=1`` on the CPU and at model shapes
on CUDA. The interpreter must be switched on before ``triton.jit`` wraps the kernels and it
patches ``triton.language`` while a kernel runs, so test_triton_backend.py runs the interpreted
cases in a child process: ``TRITON_INTERPRET=1 python -m tests.engine.attention.kernel_checks``
prints one JSON object, case name -> error message or null.

The references are the torch path run in float32 on the same (possibly 16-bit) values, over
clean caches; the Triton kernels run over caches whose unused slots hold NaN.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention import torch_backend, triton_backend
from tests.engine.attention.paged import make_paged_kv, rel_err
from tests.triton_interpreter import report

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def check_write_kv(device: str, dtype: torch.dtype, *, num_tokens: int, num_kv_heads: int,
                   head_dim: int, block_size: int, key_dtype: torch.dtype | None = None,
                   seed: int = 0) -> None:
    """Only the named slots change, bit for bit as the torch path writes them; -1 is skipped.

    The caches are the middle layer's views of a pool, as in the engine, so a write outside
    them lands in a neighbouring layer and shows.
    """
    gen = torch.Generator(device).manual_seed(seed)
    num_blocks = -(-2 * num_tokens // block_size) + 1
    # [num_layers, K/V, num_blocks, block_size, num_kv_heads, head_dim]
    pool = torch.full((3, 2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                      dtype=dtype, device=device)
    pool[:, 1] = 1e4
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen, device=device)[: num_tokens // 4]] = -1
    # K and V as views of one fused projection, as the model produces them: strided rows.
    fused = torch.randn(num_tokens, 3, num_kv_heads * head_dim, generator=gen, device=device)
    fused = fused.to(key_dtype or dtype)
    key = fused[:, 1].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, 2].view(num_tokens, num_kv_heads, head_dim)

    expected = pool.clone()
    keep = slots >= 0
    torch_backend.write_kv(key[keep], value[keep], expected[1, 0], expected[1, 1], slots[keep])
    triton_backend.write_kv(key, value, pool[1, 0], pool[1, 1], slots)
    assert torch.equal(_bits(pool[1, 0]), _bits(expected[1, 0])), "k_cache differs"
    assert torch.equal(_bits(pool[1, 1]), _bits(expected[1, 1])), "v_cache differs"
    assert torch.equal(_bits(pool), _bits(expected)), "wrote outside this layer's caches"


def check_prefill(device: str, dtype: torch.dtype, *, chunks: list[tuple[int, int]],
                  num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  host_offsets: bool = True, seed: int = 0) -> float:
    """chunks: (chunk length, context length incl. the chunk) per sequence."""
    gen = torch.Generator(device).manual_seed(seed)
    q_lens, seq_lens = (list(x) for x in zip(*chunks))
    paged = make_paged_kv(gen, seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          block_size=block_size, dtype=dtype)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    query_start_loc = (0, *torch.tensor(q_lens).cumsum(0).tolist())
    scale = head_dim ** -0.5
    ref = torch_backend.prefill_attention(query.float(), paged.k_cache.float(),
                                          paged.v_cache.float(), paged.block_tables,
                                          query_start_loc, seq_lens, scale)
    paged.poison(float("nan"))
    if host_offsets:
        offsets, lens = query_start_loc, tuple(seq_lens)
    else:
        offsets = torch.tensor(query_start_loc, dtype=torch.int32, device=device)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = triton_backend.prefill_attention(query, paged.k_cache, paged.v_cache,
                                           paged.block_tables, offsets, lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"prefill rel err {err:.2e}"
    return err


def check_decode(device: str, dtype: torch.dtype, *, seq_lens: list[int], num_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int, num_splits: int | None = None,
                 seed: int = 0) -> float:
    gen = torch.Generator(device).manual_seed(seed)
    paged = make_paged_kv(gen, seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          block_size=block_size, dtype=dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    ref = torch_backend.decode_attention(query.float(), paged.k_cache.float(),
                                         paged.v_cache.float(), paged.block_tables, lens,
                                         max(seq_lens), scale)
    paged.poison(float("nan"))
    out = triton_backend.decode_attention(query, paged.k_cache, paged.v_cache, paged.block_tables,
                                          lens, max(seq_lens), scale, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == query.shape
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"decode rel err {err:.2e}"
    return err


def check_decode_empty_context(device: str, dtype: torch.dtype, *, num_splits: int) -> None:
    """A padded batch entry (seq_len 0) yields zeros and leaves its neighbours intact."""
    gen = torch.Generator(device).manual_seed(0)
    paged = make_paged_kv(gen, [70, 1], num_kv_heads=2, head_dim=16, block_size=16, dtype=dtype)
    query = torch.randn(3, 4, 16, generator=gen, device=device).to(dtype)
    table = torch.cat([paged.block_tables, paged.block_tables[:1]])
    lens = torch.tensor([70, 0, 1], dtype=torch.int32, device=device)
    ref = torch_backend.decode_attention(query.float(), paged.k_cache.float(),
                                         paged.v_cache.float(), table, lens, 70, 0.25)
    out = triton_backend.decode_attention(query, paged.k_cache, paged.v_cache, table, lens, 70,
                                          0.25, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_err(out[[0, 2]], ref[[0, 2]]) < TOLERANCE[dtype]


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16
_SMALL = dict(num_heads=6, num_kv_heads=2, head_dim=32)
# Prefix-less, prefixed, one-token and exact-block chunks; the last spans two 64-row query
# tiles over a prefix longer than one K/V tile, so the unmasked loop runs too.
_CHUNKS = [(5, 5), (7, 20), (1, 9), (16, 16), (70, 100)]
# Length 1, exact block multiples and ragged lengths; 130 spans three 64-token splits.
_DECODE_LENS = [37, 1, 16, 130, 32]

INTERPRETER_CASES: dict[str, Callable[[], object]] = {
    "write_kv_f32": lambda: check_write_kv("cpu", _F32, num_tokens=12, num_kv_heads=3,
                                           head_dim=16, block_size=4),
    "write_kv_bf16": lambda: check_write_kv("cpu", _BF16, num_tokens=12, num_kv_heads=2,
                                            head_dim=32, block_size=16),
    # Not float32 into bfloat16: the interpreter truncates that cast where GPUs round to nearest.
    "write_kv_f32_into_f16": lambda: check_write_kv("cpu", _F16, num_tokens=8, num_kv_heads=2,
                                                    head_dim=16, block_size=4, key_dtype=_F32),
    "prefill_f32_block4": lambda: check_prefill("cpu", _F32, chunks=_CHUNKS, block_size=4,
                                                **_SMALL),
    "prefill_bf16_block16": lambda: check_prefill("cpu", _BF16, chunks=_CHUNKS, block_size=16,
                                                  **_SMALL),
    "prefill_f16_mha_device_offsets": lambda: check_prefill(
        "cpu", _F16, chunks=[(3, 3), (4, 19)], num_heads=2, num_kv_heads=2, head_dim=16,
        block_size=16, host_offsets=False),
    "decode_f32_block4": lambda: check_decode("cpu", _F32, seq_lens=_DECODE_LENS, block_size=4,
                                              **_SMALL),
    "decode_bf16_block16": lambda: check_decode("cpu", _BF16, seq_lens=_DECODE_LENS,
                                                block_size=16, **_SMALL),
    "decode_f32_split3_gqa4": lambda: check_decode(
        "cpu", _F32, seq_lens=_DECODE_LENS, num_heads=8, num_kv_heads=2, head_dim=16,
        block_size=16, num_splits=3),
    "decode_bf16_split3_mha": lambda: check_decode(
        "cpu", _BF16, seq_lens=_DECODE_LENS, num_heads=2, num_kv_heads=2, head_dim=16,
        block_size=4, num_splits=3),
    "decode_empty_context": lambda: check_decode_empty_context("cpu", _F32, num_splits=1),
    "decode_empty_context_split": lambda: check_decode_empty_context("cpu", _F32, num_splits=2),
}


if __name__ == "__main__":
    report(INTERPRETER_CASES)
