"""Decode-step linears read straight from a GGUF file's quantized blocks (``engine/csrc/quant_linear.c``).

Runs in a CPU worker's engine thread. A GGUF model's weights are dequantized at load into the
model's dense (oneDNN-packed) linears, which prefill chunks use. A decode step multiplies a few
rows by every weight, so it is bound by how many weight bytes it reads: a Q4_1 weight is 5 bits
where the dense model holds 32 (float32) or 16 (bfloat16). ``PackedLinear`` therefore also keeps
the quantized blocks (``QuantizedWeight``) and, for inputs of at most ``max_batch`` rows, calls
the C kernel, which dequantizes each block in registers to the same float32 values the dense
weights hold (rounded to bfloat16 for a bfloat16 model, on AMX or with vdpbf16ps). On a CPU with
AVX512-BF16 and no AMX, a bfloat16 model's Q4_0 / Q4_1 / Q8_0 blocks are instead rewritten at
load into the interleaved kernel's layout (``interleaved_for``), which multiplies the GGUF values
themselves, the scales applied per block in float32. ``measure_max_batch`` picks ``max_batch``
on this machine at load: the largest tested batch at which the blocks were faster than the dense
weights for the model's own linears.
``tuned_max_batch`` keeps each answer in ``$TANDEM_CACHE_DIR/tuning`` (default
``~/.cache/tandem/tuning``), keyed by everything the timing depends on, so a worker that starts
again (a restart after a crash, a scale-up, the next ``tandem serve``) does not time it again.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import platform
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.gguf_file import QTYPES
from engine.native import CSRC, KernelBuildError, build, cache_dir

if TYPE_CHECKING:
    from engine.models.layers import PackedLinear

logger = logging.getLogger(__name__)
SOURCE = CSRC / "quant_linear.c"
ABI_VERSION = 5
TUNE_BATCHES = (1, 4, 8, 16, 32, 64, 128, 256)   # up to the first batch where the dense weights win
TUNE_DENSE_BYTES = 512 << 20   # beyond any L3: the timed weights stream from memory
# A timing taken while another process held this worker's cores (its neighbour on the node
# loading weights: SmolLM2 at 8 rows timed 38.9 ms quantized vs 15.4 dense that way, where alone
# it is 8.6 vs 15.0) is timed again after a pause, and never kept in the tuning cache.
TUNE_MIN_CPU_SHARE = 0.85
TUNE_ATTEMPTS = 3
TUNE_RETRY_S = 3.0
STATUS_MESSAGES = {1: "out of memory", 2: "bad shape", 3: "unsupported quantization type", 4: "no AVX-512"}

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


@dataclass(frozen=True)
class QuantizedWeight:
    """``rows`` weight rows of ``in_features`` each, as GGUF blocks: ``data`` is uint8 ``[rows,
    row_bytes]``; or, ``interleaved``, one uint8 vector in the layout of the vdpbf16ps kernel
    (``interleaved_for``): groups of 16 rows whose quants one instruction multiplies together."""

    qtype: int
    data: torch.Tensor
    in_features: int
    rows: int
    interleaved: bool = False

    @property
    def name(self) -> str:
        return QTYPES[self.qtype][0]

    @staticmethod
    def row_bytes(qtype: int, in_features: int) -> int:
        _, weights, nbytes = QTYPES[qtype]
        return in_features // weights * nbytes

    @classmethod
    def from_blocks(cls, qtype: int, blocks: np.ndarray, in_features: int) -> QuantizedWeight:
        """``blocks``: uint8 ``[rows, row_bytes]`` as a GGUF tensor stores them (copied)."""
        if qtype not in QTYPES or in_features % QTYPES[qtype][1]:
            raise ValueError(f"GGML type {qtype} with {in_features} input features has no quantized kernel")
        if blocks.ndim != 2 or blocks.dtype != np.uint8 or blocks.shape[1] != cls.row_bytes(qtype, in_features):
            raise ValueError(f"blocks {blocks.shape} {blocks.dtype} are not rows of {in_features} "
                             f"{QTYPES[qtype][0]} weights")
        return cls(qtype, torch.from_numpy(np.array(blocks, order="C", copy=True)), in_features, blocks.shape[0])

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """The rows of ``parts`` one after the other (a fused q/k/v or gate/up weight); None when
        they differ in type or width (the fused linear then stays dense). GGUF blocks only."""
        assert not any(p.interleaved for p in parts), "concatenate the GGUF blocks, then interleave"
        if len({(p.qtype, p.in_features) for p in parts}) != 1:
            return None
        return cls(parts[0].qtype, torch.cat([p.data for p in parts]), parts[0].in_features,
                   sum(p.rows for p in parts))


class _Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        if lib.tandem_qlinear_abi_version() != ABI_VERSION:
            raise KernelBuildError(f"quant_linear ABI {lib.tandem_qlinear_abi_version()}, expected {ABI_VERSION}")
        self.supported = bool(lib.tandem_qlinear_supported())
        self._fn = lib.tandem_qlinear
        self._fn.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i32, _ptr, _i64, _i32]
        self._fn.restype = ctypes.c_int
        # bfloat16 in and out: on the AMX unit where the CPU has one (and Linux grants it), else
        # with AVX512-BF16's vdpbf16ps where the CPU has that.
        self.bf16 = bool(lib.tandem_qlinear_bf16_supported())
        self.amx = bool(lib.tandem_linear_bf16_supported())
        self._fn_bf16 = lib.tandem_qlinear_bf16
        self._fn_bf16.argtypes = self._fn.argtypes
        self._fn_bf16.restype = ctypes.c_int
        # bfloat16 in and out from the interleaved layout (tandem_qlinear_x16): CPUs with
        # AVX512-BF16 where the AMX kernel does not run.
        self.x16 = bool(lib.tandem_qlinear_x16_supported()) and not self.amx
        self._fn_x16 = lib.tandem_qlinear_x16
        self._fn_x16.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i32, _ptr, _i64, _i32]
        self._fn_x16.restype = ctypes.c_int
        self._x16_bytes = lib.tandem_qlinear_x16_bytes
        self._x16_bytes.argtypes = [_i64, _i64, _i32]
        self._x16_bytes.restype = _i64
        self._x16_pack = lib.tandem_qlinear_x16_pack
        self._x16_pack.argtypes = [_ptr, _i64, _i64, _i64, _i32, _ptr]
        self._x16_pack.restype = ctypes.c_int
        # Dense bfloat16 rows through the AMX unit (decode steps of a bf16 model, GGUF or not).
        self._fn_rows = lib.tandem_linear_bf16
        self._fn_rows.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i32]
        self._fn_rows.restype = ctypes.c_int

    def rows(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for bfloat16 ``x`` and a row-major bfloat16 ``weight`` on AMX."""
        return self._run("AMX linear kernel", self._fn_rows, x, weight.shape[0],
                         (weight.shape[1], weight.data_ptr(), weight.stride(0), weight.shape[0]), bias, torch.bfloat16)

    def interleave(self, weight: QuantizedWeight) -> QuantizedWeight | None:
        """``weight``'s blocks rewritten for tandem_qlinear_x16, or None for a type it does not read."""
        nbytes = self._x16_bytes(weight.rows, weight.in_features, weight.qtype)
        if weight.interleaved or nbytes < 0:
            return None
        data = torch.empty(nbytes, dtype=torch.uint8)
        status = self._x16_pack(weight.data.data_ptr(), weight.data.shape[1], weight.rows, weight.in_features,
                                weight.qtype, data.data_ptr())
        if status != 0:
            raise ValueError(f"interleaving {weight.name} blocks: {STATUS_MESSAGES.get(status, status)}")
        return QuantizedWeight(weight.qtype, data, weight.in_features, weight.rows, interleaved=True)

    def __call__(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        dtype = x.dtype
        if weight.interleaved:
            if dtype != torch.bfloat16 or not self.x16:
                raise ValueError(f"interleaved {weight.name} blocks take bfloat16 inputs on a CPU with "
                                 f"AVX512-BF16, not {dtype}")
            return self._run("interleaved quantized linear kernel", self._fn_x16, x, weight.rows,
                             (weight.in_features, weight.data.data_ptr(), weight.data.numel(), weight.rows,
                              weight.qtype), bias,
                             torch.bfloat16)
        blocks = (weight.in_features, weight.data.data_ptr(), weight.data.shape[1], weight.rows, weight.qtype)
        if dtype == torch.bfloat16 and self.bf16:
            return self._run("quantized linear kernel", self._fn_bf16, x, weight.rows, blocks, bias, torch.bfloat16)
        out = self._run("quantized linear kernel", self._fn, x.float(), weight.rows, blocks, bias, torch.float32)
        return out if dtype == torch.float32 else out.to(dtype)

    @staticmethod
    def _run(name: str, fn, x: torch.Tensor, num_out: int, weight_args: tuple, bias: torch.Tensor | None,
             dtype: torch.dtype) -> torch.Tensor:
        """``fn``'s product of ``x`` (in ``dtype``) and the weight its ``weight_args`` describe
        (the C arguments between x's and out's), ``num_out`` columns of ``dtype`` out."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], num_out, dtype=dtype)
        status = fn(x.data_ptr(), x.stride(0), x.shape[0], *weight_args, out.data_ptr(), out.stride(0),
                    torch.get_num_threads())
        if status != 0:
            raise ValueError(f"{name}: {STATUS_MESSAGES.get(status, status)}")
        if bias is not None:
            out += bias
        return out


@lru_cache(maxsize=1)
def load() -> _Kernel | None:
    """The kernel, or None where it cannot be built or has no AVX-512 (dense weights only)."""
    try:
        kernel = _Kernel(ctypes.CDLL(str(build(SOURCE))))
    except (KernelBuildError, OSError) as exc:
        logger.warning("quantized GGUF linears unavailable, decoding with the dense weights: %s", exc)
        return None
    return kernel if kernel.supported else None


def amx_rows_available(dtype: torch.dtype) -> bool:
    """Whether ``rows_linear`` runs here for ``dtype``: bfloat16 on a CPU with AMX."""
    kernel = load()
    return dtype == torch.bfloat16 and kernel is not None and kernel.amx


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, bfloat16, from the row-major ``weight`` on AMX (see
    ``amx_rows_available``)."""
    kernel = load()
    assert kernel is not None and kernel.amx
    return kernel.rows(x, weight, bias)


def interleaved_for(weight: QuantizedWeight, dtype: torch.dtype) -> QuantizedWeight:
    """The blocks a linear of ``dtype`` inputs keeps: for bfloat16 on a CPU with AVX512-BF16 and
    no AMX (where the interleaved kernel runs), Q4_0 / Q4_1 / Q8_0 rewritten into its layout,
    which takes the dequantization out of the products (SmolLM2's 121 linears at 8 rows, 2
    threads: 10.2 ms against 17.2 for the tiles tandem_qlinear_bf16 dequantizes); anything else
    as it is."""
    kernel = load()
    if dtype != torch.bfloat16 or kernel is None or not kernel.x16:
        return weight
    return kernel.interleave(weight) or weight


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(weight).T (+ bias)`` in ``x``'s dtype (computed in float32)."""
    kernel = load()
    if kernel is None:
        raise KernelBuildError("the quantized linear kernel is not available on this machine")
    return kernel(x, weight, bias)


@contextlib.contextmanager
def measuring_alone() -> Iterator[None]:
    """Held while a worker times its linears: workers of one node starting together (prefill
    and decode of `tandem serve`) take turns instead of timing each other's load. Best effort:
    without a writable cache directory the measurement runs unlocked."""
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        handle = open(cache_dir() / "quant_linear.lock", "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tuning_dir() -> Path:
    return cache_dir().parent / "tuning"


def _tuning_key(kind: str, linears: list[PackedLinear], dtype: torch.dtype) -> str:
    """What the timing depends on: the kernel library (its name hashes the C source, the flags,
    the compiler and this CPU's feature flags), torch (oneDNN, the dense path), the thread count,
    the dtype, and the linears' shapes, block types and AMX rows choice (the GGUF blocks are timed
    against whichever dense path that left)."""
    shapes = [(lin.in_features, lin.out_features, lin.bias is not None, lin.quant.qtype if lin.quant else None,
               lin.rows_max_batch if lin.rows is not None else -1) for lin in linears]
    parts = [kind, build(SOURCE).name, torch.__version__, torch.get_num_threads(), str(dtype),
             platform.processor() or platform.machine(), TUNE_BATCHES, TUNE_DENSE_BYTES, shapes]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def _read_tuning(path: Path) -> tuple[int, dict[int, tuple[float, float]]] | None:
    try:
        entry = json.loads(path.read_text())
        return int(entry["max_batch"]), {int(b): (float(c), float(d)) for b, (c, d) in entry["timings"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None   # absent, or not what this version writes: time again


def tuned_max_batch(kind: str, linears: list[PackedLinear], dtype: torch.dtype,
                    candidate: Callable[[PackedLinear, torch.Tensor], torch.Tensor] | None = None,
                    baseline: Callable[[PackedLinear, torch.Tensor], torch.Tensor] | None = None
                    ) -> tuple[int, dict[int, tuple[float, float]], Path | None]:
    """``measure_max_batch``'s answer, timed alone on this node (``measuring_alone``) the
    first time and read from the tuning cache after that. Returns it with the cache file it
    came from (None when timed now). Workers starting together: the first times it, the
    others wait for the lock and read its answer."""
    path = tuning_dir() / f"{kind}-{_tuning_key(kind, linears, dtype)}.json"
    if (found := _read_tuning(path)) is not None:
        return (*found, path)
    with measuring_alone():
        if (found := _read_tuning(path)) is not None:
            return (*found, path)
        for attempt in range(1, TUNE_ATTEMPTS + 1):
            started, cpu_started = time.perf_counter(), _process_cpu_seconds()
            max_batch, timings = measure_max_batch(linears, dtype, candidate=candidate, baseline=baseline)
            share = cpu_share(time.perf_counter() - started, _process_cpu_seconds() - cpu_started)
            if share >= TUNE_MIN_CPU_SHARE:
                break
            logger.info("timing %s disturbed (attempt %d of %d): this process got %.0f%% of its %d threads' CPU "
                        "time; quantized vs dense %s", kind, attempt, TUNE_ATTEMPTS, 100 * share,
                        torch.get_num_threads(), timings)
            if attempt < TUNE_ATTEMPTS:
                time.sleep(TUNE_RETRY_S)
        else:
            logger.warning("timing %s: other processes kept taking this worker's cores; using the last timing "
                           "for this start only, not keeping it in the tuning cache", kind)
            return max_batch, timings, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"max_batch": max_batch, "timings": timings,
                                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
        tmp.replace(path)   # whole or absent for a reader
    except OSError as exc:
        logger.warning("tuning cache %s not written (%s): the next start times the linears again", path, exc)
    return max_batch, timings, None


def measure_max_batch(linears: list[PackedLinear], dtype: torch.dtype, batches: tuple[int, ...] = TUNE_BATCHES,
                      repeats: int = 3, dense_bytes: int = TUNE_DENSE_BYTES,
                      candidate: Callable[[PackedLinear, torch.Tensor], torch.Tensor] | None = None,
                      baseline: Callable[[PackedLinear, torch.Tensor], torch.Tensor] | None = None
                      ) -> tuple[int, dict[int, tuple[float, float]]]:
    """The largest of ``batches`` up to which every tested batch ran ``linears`` faster through
    ``candidate`` (default: each one's quantized blocks) than through ``baseline`` (default: its
    oneDNN-packed dense weights); 0 when batch 1 did not. Times the first linears holding
    ``dense_bytes`` of dense weights (all of a small model), each once per batch and path (best
    of ``repeats``), so the weights stream from memory as in a decode step while a large model's
    start-up does not pay for timing all of them. Returns it with {batch: (candidate ms,
    baseline ms)}."""
    sample, total = [], 0
    for lin in linears:
        if total >= dense_bytes:
            break
        sample.append(lin)
        total += lin.in_features * lin.out_features * dtype.itemsize
    linears = sample
    fast = candidate or (lambda lin, x: lin.quantized_forward(x))
    slow = baseline or (lambda lin, x: lin.dense_forward(x))
    widths = {lin.in_features for lin in linears}
    timings: dict[int, tuple[float, float]] = {}
    best = 0
    with torch.no_grad():
        for batch in batches:
            xs = {k: torch.randn(batch, k).to(dtype) for k in widths}

            def run(quantized: bool) -> float:
                started = time.perf_counter()
                for lin in linears:
                    x = xs[lin.in_features]
                    (fast if quantized else slow)(lin, x)
                return (time.perf_counter() - started) * 1e3

            run(True), run(False)   # warm-up: first-touch of scratch, oneDNN primitive creation
            # alternated, so a disturbance that lasts a while slows both paths, not one
            pairs = [(run(True), run(False)) for _ in range(repeats)]
            q_ms, d_ms = min(q for q, _ in pairs), min(d for _, d in pairs)
            timings[batch] = (q_ms, d_ms)
            if q_ms >= d_ms:
                break
            best = batch
    return best, timings


def cpu_share(seconds: float, cpu_seconds: float) -> float:
    """The share of this process's torch threads' CPU time it got over ``seconds`` of wall time in
    which it used ``cpu_seconds``: near 1 on cores it had to itself (OpenMP threads spin between
    regions), lower where another process took them (a starting worker loading its weights)."""
    return cpu_seconds / max(seconds * torch.get_num_threads(), 1e-9)


def _process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
