"""Engine throughput on this machine next to the memory-bandwidth roofline (a script, not a test).

Prints decode tokens/s at several batch sizes and prefill tokens/s, for float32 and bfloat16,
beside the roofline: a decode step must read every weight once, so at batch B the ceiling is
B x (measured copy bandwidth / weight bytes). Usage:

    python benchmarks/engine.py [--model NAME|PATH] [--batches 1,8,32,64] [--dtypes float32,bfloat16]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# `engine` package: put the repository root there instead.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from engine.config import CacheConfig, ModelConfig, SamplingParams, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402


def copy_bandwidth_gbps(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Best-of-N large copy, counting bytes read plus bytes written (the traffic a step costs)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def weight_nbytes(engine: LLMEngine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def _prompts(rng: random.Random, vocab: int, batch: int, length: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(batch)]


def bench_decode(engine: LLMEngine, batch: int, prompt_len: int, steps: int, rng: random.Random) -> float:
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, _prompts(rng, engine.runner.arch.vocab_size, batch, prompt_len)):
        engine.add_request(request_id, prompt, params)
    # Prefill (and one decode step to warm up) before timing pure decode steps.
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    for request_id in ids:
        engine.abort_request(request_id)
    return batch * steps / elapsed


def bench_prefill(engine: LLMEngine, batch: int, prompt_len: int, rng: random.Random) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = _prompts(rng, engine.runner.arch.vocab_size, batch, prompt_len)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{time.monotonic_ns()}-{i}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return batch * prompt_len / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--json", action="store_true", help="also print one JSON line of results")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth_gbps()
    print(f"threads: {torch.get_num_threads()}  copy bandwidth (read+write): {bandwidth:.1f} GB/s")
    results = {"copy_gbps": bandwidth, "runs": []}
    for dtype in args.dtypes.split(","):
        engine = LLMEngine(ModelConfig(model=args.model, dtype=dtype, device="cpu"),
                           CacheConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False),
                           SchedulerConfig(max_num_seqs=max(batches), chunked_prefill_size=2048))
        nbytes = weight_nbytes(engine)
        rng = random.Random(0)
        step_floor_s = nbytes / (bandwidth * 1e9)
        print(f"\n{args.model} {dtype}: weights {nbytes / 1e6:.0f} MB -> roofline "
              f"{1 / step_floor_s:.1f} decode steps/s")
        print(f"{'batch':>6} {'decode tok/s':>13} {'roofline tok/s':>15} {'ratio':>6}")
        for batch in batches:
            tps = bench_decode(engine, batch, args.prompt_len, args.decode_steps, rng)
            roof = batch / step_floor_s
            print(f"{batch:>6} {tps:>13.1f} {roof:>15.1f} {tps / roof:>6.2f}")
            results["runs"].append({"dtype": dtype, "batch": batch, "decode_tps": tps,
                                    "roofline_tps": roof, "ratio": tps / roof})
        prefill = bench_prefill(engine, 4, args.prefill_len, rng)
        print(f"prefill: {prefill:.1f} tok/s (4 prompts x {args.prefill_len} tokens)")
        results["runs"].append({"dtype": dtype, "prefill_tps": prefill})
        engine.close()
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
