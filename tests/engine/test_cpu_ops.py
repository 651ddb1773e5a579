"""The fused C layer ops (engine/models/cpu_ops.py) against the torch ops they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.torch_backend import write_kv
from engine.models import cpu_ops
from engine.models.layers import RMSNorm, RotaryEmbedding, apply_rotary


@pytest.fixture(scope="module")
def ops():
    loaded = cpu_ops.load()
    assert loaded is not None, "the C layer ops must build on the test machine (gcc)"
    return loaded


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_add_rms_norm_matches_torch(ops, dtype, tol, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(576, generator=gen)).float()
    wide = torch.randn(num_tokens, 700, generator=gen).to(dtype)
    x = wide[:, 50:626]                      # strided rows, as a column slice of a bigger output
    residual = torch.randn(num_tokens, 576, generator=gen)
    want, want_res = norm.add_norm(x, residual.clone())
    first, first_res = norm.add_norm(x, None)
    norm.ops = ops
    got, got_res = norm.add_norm(x, residual.clone())
    got_first, got_first_res = norm.add_norm(x, None)
    assert got.dtype == dtype and got_res.dtype == torch.float32
    assert torch.allclose(got_res, want_res, atol=1e-6)
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(got_first_res, first_res)
    assert torch.allclose(got_first.float(), first.float(), rtol=tol, atol=tol)
    # reference in float64
    ref = F.rms_norm(want_res.double(), (576,), norm.weight.double(), 1e-5)
    assert torch.allclose(got.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_store_kv_matches_torch(ops, dtype, tol, head_dim):
    """q and k rotated in place as apply_rotary does, and k/v stored where write_kv stores them."""
    gen = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.device("cpu"))
    num_tokens, heads, kv_heads, extra = 9, 4, 2, 1   # rows [q | k | v | one more head]
    width = (heads + 2 * kv_heads + extra) * head_dim
    qkv = torch.randn(num_tokens, width + 5, generator=gen).to(dtype)[:, 5:]     # strided rows
    positions = torch.tensor([0, 1, 2, 15, 16, 300, 1023, 4000, 5])
    slots = torch.tensor([3, 17, 40, 41, 0, 63, 22, 8, 9])
    qk = heads + kv_heads
    want = apply_rotary(qkv[:, :qk * head_dim].reshape(num_tokens, qk, head_dim), rotary(positions))
    v = qkv[:, qk * head_dim:(qk + kv_heads) * head_dim].reshape(num_tokens, kv_heads, head_dim).clone()
    untouched = qkv[:, (qk + kv_heads) * head_dim:].clone()
    caches = [torch.randn(4, 16, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    want_k, want_v = caches[0].clone(), caches[1].clone()
    write_kv(want[:, heads:], v, want_k, want_v, slots)

    ops.rotary_store_kv(qkv, heads, kv_heads, head_dim, positions, rotary.cos, rotary.sin, slots, *caches)
    got = qkv[:, :qk * head_dim].reshape(num_tokens, qk, head_dim)
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(qkv[:, qk * head_dim:(qk + kv_heads) * head_dim].reshape(num_tokens, kv_heads, head_dim), v)
    assert torch.equal(qkv[:, (qk + kv_heads) * head_dim:], untouched)
    # the cache holds exactly the rotated k rows and the v rows, elsewhere what it held
    want_k.view(-1, kv_heads, head_dim)[slots] = got[:, heads:]
    assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v)


def test_rotary_store_kv_rejects_a_slot_outside_the_cache(ops):
    rotary = RotaryEmbedding(64, 128, 10000.0, None, torch.device("cpu"))
    qkv = torch.randn(2, 3 * 64)
    caches = [torch.zeros(2, 16, 1, 64) for _ in range(2)]
    with pytest.raises(IndexError, match="1 KV slots outside the cache's 32"):
        ops.rotary_store_kv(qkv, 1, 1, 64, torch.tensor([0, 1]), rotary.cos, rotary.sin,
                            torch.tensor([5, 32]), *caches)
    assert caches[0].view(-1, 64)[5].abs().sum() > 0 and caches[0].view(-1, 64)[32 - 1].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,inter", [(1, 1536), (7, 40), (16, 1536)])
def test_silu_mul_matches_torch(ops, dtype, num_tokens, inter):
    """silu(gate) * up with torch's roundings: bfloat16 results within one bfloat16 step of
    torch's (silu's exp differs from torch's in the last float32 bit, which can move a rounding
    that falls on a tie) and equal in nearly all elements; float32 within a few float32 ulps."""
    gen = torch.Generator().manual_seed(num_tokens * inter)
    wide = (4 * torch.randn(num_tokens, 2 * inter + 3, generator=gen)).to(dtype)
    wide[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 3.0, -3.0])
    gate_up = wide[:, 3:]                                 # strided rows
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate).mul_(up)
    got = ops.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (num_tokens, inter)
    if dtype == torch.bfloat16:
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-30)
        assert (got != want).float().mean() < 1e-3
    else:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-30)
    ref = (gate.double() * torch.sigmoid(gate.double()) * up.double())
    assert torch.allclose(got.double(), ref, rtol=2 ** -6 if dtype == torch.bfloat16 else 1e-5, atol=1e-30)


def test_prefill_sized_calls_split_over_threads_with_the_one_thread_results(ops, monkeypatch):
    """From PARALLEL_MIN_TOKENS rows the ops run on torch's threads; every row comes out as one
    thread computes it (rows are split, never a row's sum)."""
    num_tokens, heads, kv_heads, head_dim = cpu_ops.PARALLEL_MIN_TOKENS + 37, 9, 3, 64
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, 576, generator=gen).to(torch.bfloat16)
    residual = torch.randn(num_tokens, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    gate_up = torch.randn(num_tokens, 2 * 1536, generator=gen).to(torch.bfloat16)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(torch.bfloat16)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.device("cpu"))
    positions = torch.arange(num_tokens, dtype=torch.int64)
    slots = torch.randperm(num_tokens, generator=gen)
    threads_for = cpu_ops._threads

    def run(threads: int):
        calls = []
        monkeypatch.setattr(cpu_ops, "_threads", lambda n: calls.append(n) or threads)
        caches = [torch.zeros(num_tokens // 16 + 1, 16, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(2)]
        rotated = qkv.clone()
        ops.rotary_store_kv(rotated, heads, kv_heads, head_dim, positions, rotary.cos, rotary.sin, slots, *caches)
        return (*ops.add_rms_norm(x, residual.clone(), weight, 1e-5), ops.silu_mul(gate_up), rotated, *caches)

    one, two = run(1), run(2)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    with_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert threads_for(cpu_ops.PARALLEL_MIN_TOKENS - 1) == 1
        assert threads_for(cpu_ops.PARALLEL_MIN_TOKENS) == 2
    finally:
        torch.set_num_threads(with_threads)
