"""Engine step speed on this machine (a script, not a test): decode ms per step and prefill tok/s.

For each dtype and each thread count it prints the ms of one decode step at batch 1, 16 and 64
with 256- and 1024-token contexts, prefill tokens/s (4 fresh prompts x 512 tokens; --prefill-batch), and the
memory-bandwidth floor of a decode step (every weight read once: weight bytes / measured copy
bandwidth). ``--profile`` adds a per-op table (torch.profiler) of the batch-16, 256-token step.
Usage:

    python benchmarks/engine.py [--dtypes bfloat16,float32] [--threads 1,2] [--batches 1,16,64]
                                [--contexts 256,1024] [--profile] [--json] [--device cuda]

Decode contexts are built once per (dtype, context): the largest batch is prefilled, measured,
then aborted down to each smaller batch. Thread counts are switched in the same process
(``torch.set_num_threads``; the CPU attention kernels follow it). Run it on a quiet machine.
With ``--device cuda`` the engine runs on the GPU (Triton attention); a step's wall time still
ends at the sampled token ids reaching the host, and the copy bandwidth is the device's. Each
decode row then also gives ``gpu_ms``: the GPU's kernel time per step (torch.profiler), what the
step would take if the host never kept the GPU waiting.

``--load-format dummy`` runs random weights built from the model's config alone: a profile for the
simulator (engine/sim/latency.py reads this script's ``--json`` output) of a model whose weights
are not at hand, from an HF directory holding only its config.json and tokenizer files.
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

from engine.config import LOAD_FORMATS, CacheConfig, ModelConfig, SamplingParams, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402


def copy_bandwidth_gbps(nbytes: int = 1 << 29, repeats: int = 5, device: str = "cpu") -> float:
    """Best-of-N large copy, counting bytes read plus bytes written (the traffic a step costs)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def weight_nbytes(engine: LLMEngine) -> int:
    """Bytes a decode step must stream: every linear layer and the lm_head (embedding rows are
    only looked up, so a tied embedding counts once, as the head)."""
    from engine.models.layers import PackedLinear
    model = engine.runner.model
    item = engine.runner.dtype.itemsize
    linear = sum(m.out_features * m.in_features for m in model.modules()
                 if isinstance(m, (torch.nn.Linear, PackedLinear)))
    tied_unpacked = model.lm_head is None and model.packed_head is None
    return (linear + (model.head_weight.numel() if tied_unpacked else 0)) * item


def engine_kv_bytes_per_token(model: str, dtype: str) -> int:
    from engine.loader import Checkpoint, resolve_model
    arch = Checkpoint(resolve_model(model)).arch
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * (2 if dtype in ("bfloat16", "float16") else 4)


def _prompts(rng: random.Random, vocab: int, batch: int, length: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(batch)]


def _time_steps(engine: LLMEngine, steps: int) -> float:
    """Median ms of ``steps`` decode steps (after one warm-up step)."""
    engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def bench_decode(engine: LLMEngine, batches: list[int], threads: list[int], context: int, steps: int,
                 rng: random.Random, profile: bool) -> tuple[list[dict], str | None]:
    batches = sorted(batches, reverse=True)
    prefill_steps = -(-batches[0] * context // engine.scheduler.config.chunked_prefill_size) + 1
    cuda = engine.runner.device.type == "cuda"
    params = SamplingParams(temperature=0, max_tokens=_decode_budget(batches, threads, steps, prefill_steps, cuda),
                            ignore_eos=True)
    ids = [f"ctx{context}-{i}" for i in range(batches[0])]
    for request_id, prompt in zip(ids, _prompts(rng, engine.runner.arch.vocab_size, batches[0], context)):
        engine.add_request(request_id, prompt, params)
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    rows, table = [], None
    for batch in batches:
        for request_id in ids[batch:]:
            engine.abort_request(request_id)
        ids = ids[:batch]
        for n in threads:
            torch.set_num_threads(n)
            ms = _time_steps(engine, steps)
            row = {"batch": batch, "context": context, "threads": n, "step_ms": ms, "tok_per_s": batch * 1e3 / ms}
            gpu = ""
            if engine.runner.device.type == "cuda":
                row["gpu_ms"] = gpu_busy_ms(engine, steps)
                gpu = f", GPU kernels {row['gpu_ms']:.2f} ms/step"
            if len(engine.scheduler.running) != batch:
                raise RuntimeError(f"sequences finished while batch {batch} was measured: _decode_budget "
                                   "gave them too few tokens")
            rows.append(row)
            print(f"  decode batch {batch:>3} context {context:>5} threads {n}: {ms:7.1f} ms/step "
                  f"({batch * 1e3 / ms:7.1f} tok/s{gpu})", flush=True)
            if profile and batch == 16 and n == max(threads) and table is None:
                table = profile_steps(engine, steps)
    for request_id in ids:
        engine.abort_request(request_id)
    return rows, table


def _decode_budget(batches: list[int], threads: list[int], steps: int, prefill_steps: int, cuda: bool) -> int:
    """Tokens each sequence may generate over one context's measurements: while the others
    still prefill (continuous batching), the warm-ups, the timed steps (and on CUDA the steps
    ``gpu_busy_ms`` profiles) and the profile."""
    per_row = steps + 1 + (steps if cuda else 0)
    return prefill_steps + len(threads) * len(batches) * per_row + steps + 16


def gpu_busy_ms(engine: LLMEngine, steps: int) -> float:
    """ms of GPU kernel time per decode step (torch.profiler's device time, summed over every
    kernel of ``steps`` steps): what a step would take if the host never kept the GPU waiting,
    e.g. with the step captured in a CUDA graph. The wall time per step is ``_time_steps``'s."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels_us = sum(e.self_device_time_total for e in prof.key_averages()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    return kernels_us / 1e3 / steps


def profile_steps(engine: LLMEngine, steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU]
    if engine.runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)


def bench_prefill(engine: LLMEngine, batch: int, prompt_len: int, rng: random.Random) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = _prompts(rng, engine.runner.arch.vocab_size, batch, prompt_len)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{time.monotonic_ns()}-{i}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return batch * prompt_len / (time.perf_counter() - t0)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", default="1,2", help="torch threads, comma-separated")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="256,1024", help="tokens in each sequence's context")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-batch", type=int, default=4, help="prompts in the prefill measurement")
    parser.add_argument("--chunked-prefill-size", type=int, default=2048)
    parser.add_argument("--profile", action="store_true", help="per-op table of the batch-16 step")
    parser.add_argument("--json", action="store_true", help="also print one JSON line of results")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--attention-backend", choices=["auto", "cpu", "torch", "triton"], default="auto")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                        help="dummy: random weights from the model's config alone (an HF directory with "
                             "config.json and tokenizer files is enough): a profile for a model whose weights "
                             "are not at hand; step times do not depend on the weights' values")
    args = parser.parse_args(argv)
    batches, threads, contexts = _ints(args.batches), _ints(args.threads), _ints(args.contexts)
    bandwidth = copy_bandwidth_gbps(1 << 31 if args.device == "cuda" else 1 << 29, device=args.device)
    print(f"copy bandwidth (read+write): {bandwidth:.1f} GB/s")
    # model .. chunked_prefill_size and each prefill row's kv_bytes_per_token: what a simulated
    # engine's profile needs besides the timings (engine/sim/latency.py).
    results: dict = {"copy_gbps": bandwidth, "decode": [], "prefill": [], "profiles": {}, "model": args.model,
                     "load_format": args.load_format, "device": args.device, "prefill_len": args.prefill_len,
                     "prefill_batch": args.prefill_batch, "chunked_prefill_size": args.chunked_prefill_size}
    for dtype in args.dtypes.split(","):
        torch.set_num_threads(max(threads))
        prefill_steps = -(-max(batches) * max(contexts) // args.chunked_prefill_size) + 1
        max_len = max(max(contexts) + _decode_budget(batches, threads, args.decode_steps, prefill_steps,
                                                     args.device == "cuda") + 16,
                      args.prefill_len)
        engine = LLMEngine(ModelConfig(model=args.model, dtype=dtype, device=args.device, max_model_len=max_len,
                                       attention_backend=args.attention_backend, load_format=args.load_format),
                           CacheConfig(kv_cache_memory=(max(batches) + 8) * (max_len + 32)
                                       * engine_kv_bytes_per_token(args.model, dtype),
                                       enable_prefix_caching=False, shared_memory=False),
                           SchedulerConfig(max_num_seqs=max(batches), chunked_prefill_size=args.chunked_prefill_size))
        engine.tune_kernels()   # as a worker does before it reports ready: not inside the first timed prefill
        nbytes = weight_nbytes(engine)
        rng = random.Random(0)
        print(f"\n{args.model} {dtype} (attention: {engine.runner.model.layers[0].self_attn.backend.__name__}): "
              f"weights streamed per step {nbytes / 1e6:.0f} MB -> decode floor "
              f"{nbytes / (bandwidth * 1e9) * 1e3:.1f} ms/step", flush=True)
        if args.device == "cuda":
            bench_prefill(engine, args.prefill_batch, args.prefill_len, rng)  # JIT-compile the kernels untimed
        for n in threads:
            torch.set_num_threads(n)
            tps = bench_prefill(engine, args.prefill_batch, args.prefill_len, rng)
            print(f"  prefill {args.prefill_batch} x {args.prefill_len} threads {n}: {tps:7.1f} tok/s", flush=True)
            results["prefill"].append({"dtype": dtype, "threads": n, "tok_per_s": tps,
                                       "kv_bytes_per_token": engine_kv_bytes_per_token(args.model, dtype)})
        for context in contexts:
            rows, table = bench_decode(engine, batches, threads, context, args.decode_steps, rng,
                                       args.profile and context == min(contexts))
            results["decode"] += [{"dtype": dtype, **row} for row in rows]
            if table is not None:
                print(f"\nper-op profile, {dtype}, batch 16, context {context}, {max(threads)} threads:\n{table}")
                results["profiles"][dtype] = table
        engine.close()
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
