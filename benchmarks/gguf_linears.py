"""A decode step's linears three ways on this machine (a script, not a test): ms for all of them.

Builds random weights of a model's linear shapes (default SmolLM2-135M's: per layer q/k/v fused
960 x 576, o 576 x 576, gate/up fused 3,072 x 576, down 576 x 1,536, all Q4_1; the tied head
49,152 x 576 in Q8_0, as the embedded GGUF stores them), a separate copy per layer so the weights
stream from memory as in a step, and times all of them at each batch (rows of x), best of
``--repeats``, the three paths alternated:

- ``dense``: the oneDNN-packed bfloat16 weights (``PackedLinear.dense_forward``, what prefill uses);
- ``tiled``: the GGUF blocks, each tile of rows dequantized and rounded to bfloat16 before its
  products (``tandem_qlinear_bf16``; AMX where the CPU has it, else vdpbf16ps);
- ``interleaved``: the blocks rewritten at load for vdpbf16ps (``quant_linear.interleaved_for``;
  CPUs with AVX512-BF16 and no AMX only, else skipped).

    python benchmarks/gguf_linears.py [--batches 1,4,8,16,32,64] [--threads 2] [--layers 30] [--repeats 5]

Run it on a quiet machine. ``ModelRunner.tune_kernels`` makes the same comparison at a worker's
start (dense against whichever quantized path this CPU uses) and logs it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path: put the repository root there.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from engine.models import quant_linear  # noqa: E402
from engine.models.layers import PackedLinear  # noqa: E402

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD_SHAPE = (49152, 576)


def build(layers: int) -> list[tuple[PackedLinear, quant_linear.QuantizedWeight]]:
    """(dense linear, GGUF blocks) per weight: layers x LAYER_SHAPES in Q4_1, then the Q8_0 head.
    Each shape is quantized once and copied per layer (quantizing is slow; the copies keep every
    layer's weights at their own addresses)."""
    rng = np.random.default_rng(0)
    made: dict[tuple[int, int, int], tuple[torch.Tensor, np.ndarray]] = {}
    out = []
    for (rows, cols), qtype in [(s, Q4_1) for _ in range(layers) for s in LAYER_SHAPES] + [(HEAD_SHAPE, Q8_0)]:
        if (rows, cols, qtype) not in made:
            blocks = quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
            dense = torch.from_numpy(dequantize(blocks, qtype).reshape(rows, cols)).bfloat16()
            made[(rows, cols, qtype)] = (dense, blocks)
        dense, blocks = made[(rows, cols, qtype)]
        quant = quant_linear.QuantizedWeight.from_blocks(int(qtype), blocks, cols)
        out.append((PackedLinear(dense.clone(), None), quant))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,8,16,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = quant_linear.load()
    if kernel is None or not kernel.bf16:
        print("the quantized bfloat16 kernels do not run on this CPU (no AVX512-BF16 / AMX)")
        return 1
    linears = build(args.layers)
    interleaved = ([quant_linear.interleaved_for(q, torch.bfloat16) for _, q in linears] if kernel.x16 else None)
    paths = {"dense": lambda i, x: linears[i][0].dense_forward(x),
             "tiled": lambda i, x: quant_linear.linear(x, linears[i][1])}
    if interleaved is not None:
        paths["interleaved"] = lambda i, x: quant_linear.linear(x, interleaved[i])
    mb = {"dense": sum(lin.in_features * lin.out_features * 2 for lin, _ in linears) / 1e6,
          "tiled": sum(q.data.numel() for _, q in linears) / 1e6}
    if interleaved is not None:
        mb["interleaved"] = sum(q.data.numel() for q in interleaved) / 1e6
    print(f"{len(linears)} linears, {args.threads} threads, weights read: "
          + ", ".join(f"{k} {v:.0f} MB" for k, v in mb.items())
          + ("" if interleaved is not None else " (no interleaved kernel here: AMX, or no AVX512-BF16)")
          + ", load average %.2f %.2f %.2f" % os.getloadavg())
    flops = 2 * sum(lin.in_features * lin.out_features for lin, _ in linears)
    with torch.no_grad():
        for batch in (int(b) for b in args.batches.split(",")):
            xs = {k: torch.randn(batch, k).bfloat16() for k in {lin.in_features for lin, _ in linears}}

            def run(path: str) -> float:
                started = time.perf_counter()
                for i, (lin, _) in enumerate(linears):
                    paths[path](i, xs[lin.in_features])
                return (time.perf_counter() - started) * 1e3

            for path in paths:   # warm-up: oneDNN primitives, first touch
                run(path)
            best = {path: run(path) for path in paths}
            for _ in range(args.repeats - 1):   # alternated: the machine's drift hits every path
                for path in paths:
                    best[path] = min(best[path], run(path))
            print(f"batch {batch:4d}: " + "  ".join(
                f"{path} {ms:7.2f} ms ({flops * batch / ms / 1e6:4.0f} GFLOP/s)" for path, ms in best.items()),
                flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
