"""The fused C layer ops (engine/models/cpu_ops.py) against the torch ops they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
def test_rotary_in_place_matches_torch(ops, dtype, tol, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.device("cpu"))
    num_tokens, heads, extra = 9, 4, 3        # rotate the first 4 heads of rows 7 heads wide
    qkv = torch.randn(num_tokens, (heads + extra) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 15, 16, 300, 1023, 4000, 5])
    want = apply_rotary(qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim), rotary(positions))
    untouched = qkv[:, heads * head_dim:].clone()
    ops.rotary_(qkv, heads, head_dim, positions, rotary.cos, rotary.sin)
    got = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(qkv[:, heads * head_dim:], untouched)
