"""Time the Triton fused-MoE experts against the torch grouped path on CUDA.

A script, not a test. Run from the repo root on a machine with a GPU:

    python -m benchmarks.moe_gpu [--dtype bfloat16] [--tokens 1,16,256,2048] [--sweep]

The shape is Qwen3-30B-A3B's sparse layer (128 experts of 768 features, hidden 2048, top 8)
unless flags say otherwise. Routing is a softmax over random logits, so experts are hit about
uniformly (real routers are more skewed). Each row: the median time of each path
(``triton.testing.do_bench``, L2 cleared between runs; the torch path reads the expert counts
back to the host, so its time includes that wait), the speedup, each path's relative error
against the torch path in float64, and the Triton path's rate: weight bytes of the experts hit
per second (what bounds small batches) and TFLOP/s over 2 * 3 * hidden * features FLOPs per
(token, expert) pair. ``--sweep`` also times a few other tile shapes per row.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models import fused_moe, moe  # noqa: E402

SWEEP = [fused_moe.Tiles(16, 64, 64, 4, 3), fused_moe.Tiles(16, 128, 64, 4, 3),
         fused_moe.Tiles(16, 64, 128, 4, 4), fused_moe.Tiles(32, 64, 64, 4, 3),
         fused_moe.Tiles(64, 64, 64, 4, 3), fused_moe.Tiles(64, 128, 64, 4, 3),
         fused_moe.Tiles(64, 128, 64, 8, 4), fused_moe.Tiles(128, 128, 64, 8, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tokens", default="1,16,256,2048")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--sweep", action="store_true", help="also time the tile shapes in SWEEP")
    args = parser.parse_args()
    from triton.testing import do_bench

    dtype = getattr(torch, args.dtype)
    num_experts, top_k, hidden, features = args.experts, args.top_k, args.hidden, args.intermediate
    gen = torch.Generator("cuda").manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * features, hidden, generator=gen, device="cuda") * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, features, generator=gen, device="cuda") * features ** -0.5).to(dtype)
    w13_64, w2_64 = w13.double(), w2.double()
    print(f"{torch.cuda.get_device_name()}; {args.dtype}; {num_experts} experts x {features} features, "
          f"hidden {hidden}, top {top_k}")
    print("tokens | experts hit | triton ms | torch ms | speedup | err triton | err torch | GB/s | TFLOP/s | tiles")
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(dtype)
        weights, expert_ids = moe.route(torch.randn(num_tokens, num_experts, generator=gen, device="cuda"),
                                        top_k, renormalize=True)
        ref = moe.grouped_experts(x.double(), w13_64, w2_64, weights.double(), expert_ids)

        def err(out: torch.Tensor) -> float:
            return ((out.double() - ref).norm() / ref.norm()).item()

        tiles = fused_moe.choose_tiles(num_tokens * top_k, num_experts, dtype)
        triton_ms = do_bench(lambda: fused_moe.fused_experts(x, w13, w2, weights, expert_ids, tiles))
        torch_ms = do_bench(lambda: moe.grouped_experts(x, w13, w2, weights, expert_ids))
        hit = int(expert_ids.unique().numel())
        weight_bytes = hit * 3 * hidden * features * w13.element_size()
        flops = 2 * 3 * hidden * features * num_tokens * top_k
        print(f"{num_tokens} | {hit} | {triton_ms:.3f} | {torch_ms:.3f} | {torch_ms / triton_ms:.1f}x | "
              f"{err(fused_moe.fused_experts(x, w13, w2, weights, expert_ids, tiles)):.1e} | "
              f"{err(moe.grouped_experts(x, w13, w2, weights, expert_ids)):.1e} | "
              f"{weight_bytes / triton_ms / 1e6:.0f} | {flops / triton_ms / 1e9:.1f} | {tuple(tiles)}")
        if args.sweep:
            for other in SWEEP:
                ms = do_bench(lambda: fused_moe.fused_experts(x, w13, w2, weights, expert_ids, other))
                e = err(fused_moe.fused_experts(x, w13, w2, weights, expert_ids, other))
                print(f"    sweep {tuple(other)}: {ms:.3f} ms, err {e:.1e}")


if __name__ == "__main__":
    main()
