"""Decode attention kernel of this checkout against the kernel source of a git revision (A/B).

A script, not a test. Run from the repo root:

    python -m benchmarks.attention_cpu_ab [--baseline HEAD] [--threads 2] [--rounds 3]

Both libraries are built from their sources (``git show REV:engine/csrc/paged_attention.c`` for
the baseline) and called in one process on the same inputs, the variants alternated round by
round; each cell is the best over the rounds of the median ms per call, so drift on a shared
machine hits every variant alike. Besides the baseline and the checkout, two variants of the
checkout separate its changes: ``no split`` (partition_tokens 0: no split-KV) and ``no bf16 dot``
(built with -mno-avx512bf16: the float32 products of CPUs without AVX512-BF16); ``new`` and ``no
bf16 dot`` split at ``--partition-tokens``. Shapes are
SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64), block size 16, shuffled block tables;
``rel err`` is against a float64 reference on the same cache values.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_cpu import HEAD_DIM, NUM_HEADS, SCALE, load_average, paged_caches, time_ms  # noqa: E402
from engine import native  # noqa: E402
from engine.attention import cpu_backend, cpu_kernels, torch_backend  # noqa: E402

# name -> context length per sequence
CASES = {
    "16x256": [256] * 16,
    "64x256": [256] * 64,
    "8x1024": [1024] * 8,
    "1x4096": [4096],
    "1x2048+7x128": [2048] + [128] * 7,
    "2x1536+10x200": [1536] * 2 + [200] * 10,
}
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def baseline_library(rev: str, tmp: Path) -> ctypes.CDLL:
    """The kernels as at ``rev``, called with that revision's argument list."""
    source = subprocess.run(["git", "show", f"{rev}:engine/csrc/paged_attention.c"], check=True,
                            capture_output=True, text=True).stdout
    path = tmp / "paged_attention.c"
    path.write_text(source)
    lib = ctypes.CDLL(str(native.build(path)))
    lib.tandem_paged_decode.argtypes = [ctypes.POINTER(cpu_kernels.Queries), ctypes.POINTER(cpu_kernels.KVCache),
                                        ctypes.POINTER(cpu_kernels.Seqs), ctypes.c_float, ctypes.c_int32]
    if lib.tandem_abi_version() >= 2:  # decode takes partition_tokens
        lib.tandem_paged_decode.argtypes = [*lib.tandem_paged_decode.argtypes, ctypes.c_int32]
    lib.tandem_paged_decode.restype = ctypes.c_int
    return lib


def decoder(lib: ctypes.CDLL, partition_tokens: int | None):
    """decode_attention over ``lib``; partition_tokens None: the ABI 1 call (no such argument)."""
    def run(*args):
        if partition_tokens is None:
            return cpu_backend._run(lib.tandem_paged_decode, *args[:5], None, args[6])
        return cpu_backend._run(lib.tandem_paged_decode, *args[:5], None, args[6], partition_tokens)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision of the A side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--partition-tokens", type=int, default=512, help="split-KV partition of the split variants")
    parser.add_argument("--budget-s", type=float, default=0.3, help="timing budget per variant and round")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(_DTYPES))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TANDEM_CACHE_DIR"] = tmp  # private builds, not the user's cache
        base = baseline_library(args.baseline, Path(tmp))
        new = cpu_kernels.open_library(native.build(cpu_kernels.SOURCE))
        no_bf16 = cpu_kernels.open_library(native.build(cpu_kernels.SOURCE, cflags=(*native.CFLAGS, "-mno-avx512bf16")))
        base_partition = None if base.tandem_abi_version() < 2 else 0
        variants = {args.baseline: decoder(base, base_partition), "no split": decoder(new, 0),
                    "no bf16 dot": decoder(no_bf16, args.partition_tokens),
                    "new": decoder(new, args.partition_tokens)}
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        print(f"# {load_average()}, {os.cpu_count()} CPUs, {args.threads} threads, best of {args.rounds}")
        print(f"{'case':<15} {'dtype':<9} " + " ".join(f"{n + ' ms':>14}" for n in variants)
              + f" {'base/new':>9} " + " ".join(f"{n[:8] + ' err':>13}" for n in variants))
        for dtype_name in args.dtypes:
            for name in args.cases:
                lens = CASES[name]
                k_cache, v_cache, tables = paged_caches(lens, _DTYPES[dtype_name])
                query = torch.randn(len(lens), NUM_HEADS, HEAD_DIM).to(_DTYPES[dtype_name])
                seq_lens = torch.tensor(lens, dtype=torch.int32)
                call = (query, k_cache, v_cache, tables, seq_lens, max(lens), SCALE)
                ref = torch_backend.decode_attention(query.double(), k_cache.double(), v_cache.double(),
                                                     tables, seq_lens, max(lens), SCALE)
                errs = {n: float((fn(*call).double() - ref).norm() / ref.norm()) for n, fn in variants.items()}
                best = {n: float("inf") for n in variants}
                for _ in range(args.rounds):
                    for n, fn in variants.items():
                        best[n] = min(best[n], time_ms(lambda fn=fn: fn(*call), args.budget_s))
                print(f"{name:<15} {dtype_name:<9} " + " ".join(f"{best[n]:>14.3f}" for n in variants)
                      + f" {best[args.baseline] / best['new']:>8.2f}x "
                      + " ".join(f"{errs[n]:>13.1e}" for n in variants), flush=True)
        print(f"# {load_average()}")


if __name__ == "__main__":
    main()
