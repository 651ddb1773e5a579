"""Fused elementwise ops of a decoder layer on CPU (``engine/csrc/layer_ops.c``), called through ctypes.

Runs in the engine thread of a CPU worker. Built on first use into the same kernel cache as the
CPU attention backend (``engine.native.build``). ``load()`` returns None when the
library cannot be built: the model then keeps its torch ops (same results within rounding).
A call with at least ``PARALLEL_MIN_TOKENS`` rows (a prefill chunk) splits them over torch's
threads; a smaller one (a decode step) stays on the calling thread and opens no OpenMP region.
"""
from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache

import torch

from engine.native import CSRC, KernelBuildError, build

logger = logging.getLogger(__name__)
SOURCE = CSRC / "layer_ops.c"
ABI_VERSION = 5
# Rows from which an op runs on torch's threads. On 2 AMX cores, one thread took 0.84 / 0.35 /
# 0.33 ms for silu_mul / add_rms_norm / rotary_store_kv of 1024 SmolLM2 rows (~17% of a 1024-token
# prefill step over 30 layers) and 0.05 / 0.02 / 0.02 ms of 64.
PARALLEL_MIN_TOKENS = 128
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HIDDEN, MAX_HEAD_DIM = 16384, 1024   # the C side's per-row scratch buffers

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p


class LayerOps:
    """Thin typed wrappers; every call checks what the C side assumes (dtype, contiguity)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        if lib.tandem_layer_ops_abi_version() != ABI_VERSION:
            raise KernelBuildError(f"layer ops ABI {lib.tandem_layer_ops_abi_version()}, expected {ABI_VERSION}")
        self._norm = lib.tandem_add_rms_norm
        self._norm.argtypes = [_ptr, _i64, _ptr, _int, _ptr, _ptr, _i64, _i64, _f32, _int, _int]
        self._norm.restype = None
        self._rotary_store = lib.tandem_rotary_store_kv
        self._rotary_store.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64,
                                       _ptr, _i64, _int, _int]
        self._rotary_store.restype = _int
        self._silu_mul = lib.tandem_silu_mul
        self._silu_mul.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _int, _int]
        self._silu_mul.restype = None
        self._bind_team = lib.tandem_bind_team
        self._bind_team.argtypes = [_ptr, _int, _ptr, _int]
        self._bind_team.restype = _int

    @staticmethod
    def supports(dtype: torch.dtype, hidden: int, head_dim: int) -> bool:
        return dtype in _DTYPES and hidden <= MAX_HIDDEN and head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x) in x's dtype, the new float32 residual); ``residual`` None starts
        the stream from ``x``. Updates ``residual`` in place."""
        num_tokens, hidden = x.shape
        assert x.stride(1) == 1 and weight.dtype == torch.float32 and weight.is_contiguous()
        if residual is None:
            residual, residual_in = torch.empty(num_tokens, hidden, dtype=torch.float32), 0
        else:
            assert residual.dtype == torch.float32 and residual.is_contiguous()
            residual_in = 1
        out = torch.empty(num_tokens, hidden, dtype=x.dtype)
        self._norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual_in, weight.data_ptr(), out.data_ptr(),
                   num_tokens, hidden, eps, _DTYPES[x.dtype], _threads(num_tokens))
        return out, residual

    def rotary_store_kv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                        positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Rotate the q and k heads of every ``qkv`` row in place (rotate-half; ``cos``/``sin`` are
        RotaryEmbedding's full tables), then store each token's k and v heads at ``slots[t]`` of the
        caches (``[num_blocks, block_size, num_kv_heads, head_dim]``, the qkv dtype). Rows are
        ``[q heads | k heads | v heads | ...]`` and may be strided. A slot outside the caches is an
        IndexError, as ``index_copy_`` raises, and nothing is stored for it."""
        for cache in (k_cache, v_cache):
            assert cache.dtype == qkv.dtype and cache.stride(2) == head_dim and cache.stride(3) == 1
            assert cache.stride(0) == cache.shape[1] * cache.stride(1)   # slot s at s * stride(1)
        assert qkv.stride(1) == 1 and positions.dtype == torch.int64 and positions.is_contiguous()
        assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape[0] == qkv.shape[0]
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        bad = self._rotary_store(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads, num_kv_heads, head_dim,
                                 positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), num_slots,
                                 k_cache.data_ptr(), k_cache.stride(1), v_cache.data_ptr(), v_cache.stride(1),
                                 _DTYPES[qkv.dtype], _threads(qkv.shape[0]))
        if bad:
            raise IndexError(f"{bad} KV slots outside the cache's {num_slots}")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of ``gate_up`` rows ``[gate | up]`` (rows may be strided), rounded as
        torch's ``F.silu(gate).mul_(up)`` rounds in the same dtype."""
        num_tokens, width = gate_up.shape
        assert gate_up.stride(1) == 1 and width % 2 == 0
        out = torch.empty(num_tokens, width // 2, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), num_tokens, width // 2, out.data_ptr(),
                       _DTYPES[gate_up.dtype], _threads(num_tokens))
        return out


    def bind_threads(self, num_threads: int) -> list[int]:
        """Bind the calling thread's OpenMP team of ``num_threads`` (torch's intra-op threads when
        the caller's ``torch.get_num_threads()`` is that) one thread to each CPU of this process's
        affinity mask, the caller to the first: the CPUs bound, in thread order. Only when the
        team has exactly one thread for every CPU the process may use: with fewer threads, each
        worker on a node would bind to the same first CPUs and leave the others idle. [] (nothing
        bound) then, for a team of one, or when the kernel refused."""
        allowed = sorted(os.sched_getaffinity(0))
        targets = cpus_to_bind(num_threads, allowed)
        if not targets:
            return []
        cpus = (ctypes.c_int * num_threads)(*targets)
        every = (ctypes.c_int * len(allowed))(*allowed)
        bound = self._bind_team(ctypes.addressof(cpus), num_threads, ctypes.addressof(every), len(allowed))
        return targets[:bound] if bound > 0 else []


def cpus_to_bind(num_threads: int, allowed: list[int]) -> list[int]:
    """The CPUs a team of ``num_threads`` is bound to, in thread order, when the process may use
    ``allowed``: every one of them when there is one thread for each, else none (see
    ``LayerOps.bind_threads``)."""
    return list(allowed) if 1 < num_threads == len(allowed) else []


def _threads(num_tokens: int) -> int:
    return torch.get_num_threads() if num_tokens >= PARALLEL_MIN_TOKENS else 1


@lru_cache(maxsize=1)
def load() -> LayerOps | None:
    try:
        return LayerOps(ctypes.CDLL(str(build(SOURCE))))
    except (KernelBuildError, OSError) as exc:
        logger.warning("fused CPU layer ops unavailable, using torch ops: %s", exc)
        return None

