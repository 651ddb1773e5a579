"""Builds the C libraries of ``engine/csrc/`` (paged attention, layer ops, quantized linears).

Runs in each process that loads one, on first use: ``engine/attention/cpu_kernels.py``,
``engine/models/cpu_ops.py`` and ``engine/models/quant_linear.py`` each name their source and
declare their own functions. A library is compiled with the system C compiler (``$CC``, default
``gcc``) into a per-user cache directory, ``$TANDEM_CACHE_DIR/kernels`` (default
``~/.cache/tandem/kernels``), under a name keyed by the source, the shared headers, the flags,
the compiler's version and the host CPU, so any change rebuilds. It is written to a temporary
file and renamed into place, so workers starting together never load a half-written library.
Any failure raises :class:`KernelBuildError`, which callers catch to fall back to torch.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"   # every C source and the headers they share
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120


class KernelBuildError(RuntimeError):
    """A C library could not be compiled or loaded on this machine."""


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


def library_path(source_path: Path, cc: str | None = None, cflags: tuple[str, ...] = CFLAGS) -> Path:
    """Where ``source_path`` compiled with ``cc`` and ``cflags`` on this CPU lives in the cache."""
    cc = cc or compiler()
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


def build(source_path: Path, cc: str | None = None, cflags: tuple[str, ...] = CFLAGS) -> Path:
    """The path of ``source_path`` compiled into a shared library, compiling it first unless the
    cache already holds it.

    ``cflags`` other than the default are for tests (e.g. the portable loops without AVX-512).
    """
    cc = cc or compiler()
    path = library_path(source_path, cc, cflags)
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
