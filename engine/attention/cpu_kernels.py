"""The C paged-attention kernels (``engine/csrc/paged_attention.c``) of the CPU backend: their
structs, return codes and function declarations, and the library loaded once per process.

Runs in each worker process that uses ``engine.attention.cpu_backend``, on first use; the library
is compiled by ``engine.native`` (any failure raises its :class:`KernelBuildError`, which callers
catch to fall back to the torch backend).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

from engine.native import CSRC, KernelBuildError, build

SOURCE = CSRC / "paged_attention.c"
ABI_VERSION = 3  # tandem_abi_version() in the C source; bump both when the structs change

# C return codes -> what went wrong
STATUS_MESSAGES = {1: "out of memory", 2: "num_heads is not a multiple of num_kv_heads (or head_dim < 1)",
                   3: "a sequence length exceeds its block table or a chunk exceeds its sequence",
                   4: "a block table entry is not a block of the cache",
                   5: "not supported here (the AMX prefill kernel needs AMX, bfloat16, head_dim a multiple of 32 "
                      "up to 256 and block_size a multiple of 16)"}


class KVCache(ctypes.Structure):
    """kv_cache_t: strides in elements; head_dim must be contiguous."""

    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("k_block_stride", ctypes.c_int64), ("k_slot_stride", ctypes.c_int64),
                ("k_head_stride", ctypes.c_int64),
                ("v_block_stride", ctypes.c_int64), ("v_slot_stride", ctypes.c_int64),
                ("v_head_stride", ctypes.c_int64),
                ("num_blocks", ctypes.c_int64),
                ("dtype", ctypes.c_int32), ("block_size", ctypes.c_int32),
                ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32)]


class Queries(ctypes.Structure):
    """queries_t: the query rows and the output rows, strides in elements."""

    _fields_ = [("q", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("q_token_stride", ctypes.c_int64), ("q_head_stride", ctypes.c_int64),
                ("out_token_stride", ctypes.c_int64), ("out_head_stride", ctypes.c_int64),
                ("dtype", ctypes.c_int32), ("num_heads", ctypes.c_int32)]


class Seqs(ctypes.Structure):
    """seqs_t: block tables (int32 rows) and lengths; query_start_loc is for prefill only."""

    _fields_ = [("block_tables", ctypes.c_void_p), ("block_table_stride", ctypes.c_int64),
                ("max_blocks_per_seq", ctypes.c_int64),
                ("seq_lens", ctypes.c_void_p), ("query_start_loc", ctypes.c_void_p),
                ("num_seqs", ctypes.c_int32)]


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its functions. CDLL (not PyDLL) drops the GIL per call."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from e
    if lib.tandem_abi_version() != ABI_VERSION:
        raise KernelBuildError(f"{path} has ABI version {lib.tandem_abi_version()}, expected {ABI_VERSION}")
    common: list[type] = [ctypes.POINTER(Queries), ctypes.POINTER(KVCache), ctypes.POINTER(Seqs),
                          ctypes.c_float, ctypes.c_int32]  # ..., scale, num_threads
    lib.tandem_paged_prefill.argtypes = common
    lib.tandem_paged_prefill_amx.argtypes = common
    lib.tandem_paged_decode.argtypes = [*common, ctypes.c_int32]  # ..., partition_tokens
    for fn in (lib.tandem_paged_prefill, lib.tandem_paged_prefill_amx, lib.tandem_paged_decode):
        fn.restype = ctypes.c_int
    lib.tandem_prefill_amx_ready.argtypes = []
    lib.tandem_prefill_amx_ready.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The kernels, built on first use; one library per process (failures are not cached)."""
    return open_library(build(SOURCE))
