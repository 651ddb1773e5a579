"""The engine alone on a serving-like load (a script, not a test): output tok/s without a server.

Keeps CONCURRENCY requests of INPUT random token ids in flight (a finished one is replaced at
once) until NUM have run, each generating OUTPUT tokens (ignore_eos), by calling
``LLMEngine.step()`` in a loop: the same scenarios as ``benchmarks/vs_vllm.py`` with no router,
gRPC or client beside the engine. Compare its tok/s with the served number to split a gap into
the engine's share and the serving path's (docs/performance.md); its steps by kind, mean ms, are
what a served worker's ``tandem_engine_step_seconds{kind}`` sum over count gives. Requests sample at
``--temperature`` 1.0 by default, as served ones do under vLLM's client (it sends no temperature,
and the server's default is 1.0); 0 is greedy.

    python benchmarks/engine_closed_loop.py CONCURRENCY NUM INPUT OUTPUT [--chunked-prefill-size 512]
        [--dtype auto] [--threads 2] [--temperature 1.0] [--model smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("concurrency", "num", "input", "output"):
        parser.add_argument(name, type=int)
    parser.add_argument("--chunked-prefill-size", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = LLMEngine(ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.input + args.output + 16),
                       CacheConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False, shared_memory=False),
                       SchedulerConfig(max_num_seqs=max(64, args.concurrency),
                                       chunked_prefill_size=args.chunked_prefill_size))
    engine.tune_kernels()   # as a worker does before it reports ready: not inside the timed loop
    rng = random.Random(0)
    vocab = engine.runner.arch.vocab_size
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output, ignore_eos=True)
    sent = 0

    def add() -> None:
        nonlocal sent
        engine.add_request(f"r{sent}", [rng.randrange(100, vocab) for _ in range(args.input)], params)
        sent += 1

    for _ in range(min(args.concurrency, args.num)):
        add()
    started, steps = time.perf_counter(), 0
    by_kind: dict[str, list[float]] = {}   # kind -> [steps, seconds], as tandem_engine_step_seconds counts
    while engine.has_unfinished():
        outputs = engine.step()
        if engine.last_step is not None:
            kind, seconds = engine.last_step
            count = by_kind.setdefault(kind, [0, 0.0])
            count[0] += 1
            count[1] += seconds
        for out in outputs:
            if out.finished and sent < args.num:
                add()
        steps += 1
    took = time.perf_counter() - started
    kinds = ", ".join(f"{kind} {int(n)} x {1000 * s / n:.1f}" for kind, (n, s) in sorted(by_kind.items()))
    print(f"{args.concurrency} x {args.num}, {args.input}/{args.output}: {args.num * args.output / took:.1f} "
          f"output tok/s, {took:.1f} s, {steps} steps, {1000 * took / steps:.1f} ms per step ({kinds} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
