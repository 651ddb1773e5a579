"""The fused C layer ops against the torch ops they replace, in one engine (a script, not a test).

One LLMEngine decodes a batch of 256-token contexts; steps alternate, 4 at a time, between the
fused ops (``tandem_silu_mul``, ``tandem_rotary_store_kv``) and the torch ops they replaced
(``F.silu(gate).mul_(up)``; the C rotary alone, then ``write_kv``'s two ``index_copy_``), and it
prints the median and best step ms of each. Alternating in one process keeps the machine's
drift out of the comparison. Usage:

    python benchmarks/layer_ops_ab.py [--batch 16] [--rounds 40] [--model smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# `engine` package: put the repository root there instead.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from engine.attention import torch_backend  # noqa: E402
from engine.config import CacheConfig, ModelConfig, SamplingParams, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.models.cpu_ops import _DTYPES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    engine = LLMEngine(ModelConfig(model=args.model, dtype=args.dtype, max_model_len=1024),
                       CacheConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False, shared_memory=False),
                       SchedulerConfig(max_num_seqs=256, chunked_prefill_size=0))
    rng = random.Random(0)
    steps = 5 * args.rounds * 2 + 8
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(100, 30000) for _ in range(256)],
                           SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    for _ in range(4):
        engine.step()
    model = engine.runner.model
    ops = model.layers[0].self_attn.ops
    if ops is None:
        sys.exit("the fused layer ops did not build here: nothing to compare")
    fused = ops.rotary_store_kv

    def torch_store(qkv, heads, kv_heads, dim, positions, cos, sin, slots, k_cache, v_cache) -> None:
        ops._rotary(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], heads + kv_heads, dim, positions.data_ptr(),
                    cos.data_ptr(), sin.data_ptr(), _DTYPES[qkv.dtype])
        n, k0, v0 = qkv.shape[0], heads * dim, (heads + kv_heads) * dim
        key, value = qkv[:, k0:v0], qkv[:, v0:v0 + kv_heads * dim]
        torch_backend.write_kv(key.view(n, kv_heads, dim), value.view(n, kv_heads, dim), k_cache, v_cache, slots)

    def use_fused(on: bool) -> None:
        for layer in model.layers:
            layer.mlp.ops = ops if on else None
        ops.rotary_store_kv = fused if on else torch_store

    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in (r % 2 == 0, r % 2 == 1):
            use_fused(on)
            engine.step()
            t0 = time.perf_counter()
            for _ in range(4):
                engine.step()
            times[on].append((time.perf_counter() - t0) / 4 * 1e3)
    for on in (False, True):
        v = times[on]
        print(f"batch {args.batch} {'fused C ops' if on else 'torch ops  '}: median {statistics.median(v):7.2f} ms, "
              f"best {min(v):7.2f} ms ({len(v)} x 4 steps, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
