"""Builds and loads the C paged-attention kernels (``engine/csrc/paged_attention.c``) for the CPU backend.

Runs in each worker process that uses ``engine.attention.cpu_backend``, on first use. The library
is compiled with the system C compiler (``$CC``, default ``gcc``) into a per-user cache directory,
``$TANDEM_CACHE_DIR/kernels`` (default ``~/.cache/tandem/kernels``), under a name keyed by the
source, the flags, the compiler's version and the host CPU, so any change rebuilds. It is written
to a temporary file and renamed into place, so workers starting together never load a
half-written library. Any failure raises :class:`KernelBuildError`, which callers catch to fall
back to the torch backend.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"   # every C source and the headers they share
SOURCE = CSRC / "paged_attention.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
ABI_VERSION = 3  # tandem_abi_version() in the C source; bump both when the structs change
COMPILE_TIMEOUT_S = 120

# C return codes -> what went wrong
STATUS_MESSAGES = {1: "out of memory", 2: "num_heads is not a multiple of num_kv_heads (or head_dim < 1)",
                   3: "a sequence length exceeds its block table or a chunk exceeds its sequence",
                   4: "a block table entry is not a block of the cache",
                   5: "not supported here (the AMX prefill kernel needs AMX, bfloat16, head_dim a multiple of 32 "
                      "up to 256 and block_size a multiple of 16)"}


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded on this machine."""


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


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem"
    return Path(root) / "kernels"


def compiler() -> str:
    """The C compiler command: $CC (split as a shell would, so ``ccache gcc`` works), else gcc."""
    return os.environ.get("CC") or "gcc"


def _compiler_version(cc: str) -> str:
    try:
        proc = subprocess.run([*shlex.split(cc), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"cannot run the C compiler CC={cc!r}: {e}; install gcc or set CC, "
                               "or use --attention-backend torch") from e
    if proc.returncode != 0:
        raise KernelBuildError(f"the C compiler CC={cc!r} failed on --version (exit {proc.returncode})"
                               f"{_stderr_tail(proc)}; install gcc or set CC, or use --attention-backend torch")
    return proc.stdout


def _stderr_tail(proc: subprocess.CompletedProcess) -> str:
    text = proc.stderr.strip()[-2000:]
    return f": {text}" if text else ""


def _cpu_flags() -> str:
    """The host CPU's feature flags: -march=native code must not be loaded on another CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path(cc: str | None = None, cflags: tuple[str, ...] = CFLAGS, source_path: Path | None = None) -> Path:
    cc = cc or compiler()
    source_path = source_path or SOURCE
    try:
        source = source_path.read_bytes()
    except OSError as e:  # e.g. a wheel built without the package's C files
        raise KernelBuildError(f"kernel source {source_path} is missing: {e}") from e
    key = hashlib.sha256()
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    for part in (source, headers, " ".join(cflags).encode(), cc.encode(),
                 _compiler_version(cc).encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"{source_path.stem}-{key.hexdigest()[:16]}.so"


def build(cc: str | None = None, cflags: tuple[str, ...] = CFLAGS, source_path: Path | None = None) -> Path:
    """The compiled library's path, compiling it first unless the cache already holds it.

    ``cflags`` other than the default are for tests (e.g. the portable loops without AVX-512).
    """
    cc, source_path = cc or compiler(), source_path or SOURCE
    path = library_path(cc, cflags, source_path)
    if path.exists():
        return path
    started = time.perf_counter()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A private temporary name in the same directory, renamed over the final one only when
        # complete: a concurrent builder either sees nothing or a whole library.
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise KernelBuildError(f"cannot write the kernel cache {path.parent}: {e}; set "
                               "TANDEM_CACHE_DIR to a writable directory") from e
    try:
        try:
            proc = subprocess.run([*shlex.split(cc), *cflags, f"-I{CSRC}", "-o", tmp, str(source_path)],
                                  capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KernelBuildError(f"cannot run the C compiler CC={cc!r}: {e}") from e
        if proc.returncode != 0:
            raise KernelBuildError(
                f"compiling {source_path.name} with CC={cc!r} failed (exit {proc.returncode})"
                f"{_stderr_tail(proc)}; install gcc or set CC, or use --attention-backend torch")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("compiled %s into %s in %.1f s", source_path.name, path, time.perf_counter() - started)
    return path


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
    return open_library(build())
