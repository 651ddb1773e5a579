"""`tandem bench` flags and command (bench process). Flags map 1:1 onto deploy.bench.config.

Only argparse is imported here, so building the `tandem` parser stays cheap; the load
generator, tokenizer and matplotlib are imported when the command runs.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path

from deploy.bench.config import BACKENDS, DEFAULT_MODEL, EndpointConfig, LoadConfig, SloConfig, WorkloadConfig

logger = logging.getLogger(__name__)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    e, w, d = EndpointConfig(), WorkloadConfig(), "(default: %(default)s)"
    p = sub.add_parser("bench", help="load-test a serving endpoint: latency, throughput, goodput, plots",
                       description="Load-test an OpenAI-compatible server or Tandem's gRPC API, "
                                   "with the metrics of `vllm bench serve`.")
    g = p.add_argument_group("endpoint")
    g.add_argument("--backend", choices=BACKENDS, default=e.backend)
    g.add_argument("--base-url", default=e.base_url, help=f"HTTP server for openai backends {d}")
    g.add_argument("--grpc-target", default=e.grpc_target, help=f"host:port for --backend grpc {d}")
    g.add_argument("--api-key", default=e.api_key, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--model", default=e.model, help=f"model name sent in each request {d}")
    g.add_argument("--temperature", type=float, default=e.temperature)
    g.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM extra)")
    g.add_argument("--timeout-s", type=float, default=e.timeout_s, help="per-request timeout")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=("random", "shared-prefix", "mixed"), default=w.dataset)
    g.add_argument("--dataset-path", type=Path, default=None,
                   help='JSONL, one {"prompt": ...} or {"messages": [...]} per line, optional "max_tokens" '
                        "(overrides --dataset)")
    g.add_argument("--tokenizer", default=DEFAULT_MODEL, help=f"built-in name, HF dir or .gguf {d}")
    g.add_argument("--num-prompts", type=int, default=None, help="default 100, or every JSONL line")
    g.add_argument("--input-len", type=int, default=w.input_len, help=f"random: prompt tokens {d}")
    g.add_argument("--output-len", type=int, default=w.output_len, help=f"max_tokens of every request {d}")
    g.add_argument("--num-groups", type=int, default=w.num_groups, help=f"shared-prefix: groups {d}")
    g.add_argument("--prefix-len", type=int, default=w.prefix_len, help=f"shared-prefix: shared tokens {d}")
    g.add_argument("--suffix-len", type=int, default=w.suffix_len, help=f"shared-prefix: own tokens {d}")
    g.add_argument("--short-len", type=int, default=w.short_len, help=f"mixed: short prompt tokens {d}")
    g.add_argument("--long-len", type=int, default=w.long_len, help=f"mixed: long prompt tokens {d}")
    g.add_argument("--long-fraction", type=float, default=w.long_fraction, help=f"mixed: share of long {d}")
    g.add_argument("--seed", type=int, default=w.seed, help="seeds prompts and arrival times")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean requests/s (Poisson arrivals); inf sends all at once (default)")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT objective")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT objective")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=None, help="write results.json and PNG plots here")
    g.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                   help="print two results.json side by side with B/A ratios (sends no load)")
    g.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=cmd_bench)


def configs_from_args(args: argparse.Namespace) -> tuple[EndpointConfig, WorkloadConfig, LoadConfig, SloConfig]:
    endpoint = EndpointConfig(backend=args.backend, base_url=args.base_url, grpc_target=args.grpc_target,
                              api_key=args.api_key, model=args.model, temperature=args.temperature,
                              ignore_eos=args.ignore_eos, timeout_s=args.timeout_s)
    workload = WorkloadConfig(
        dataset="jsonl" if args.dataset_path is not None else args.dataset,
        dataset_path=None if args.dataset_path is None else str(args.dataset_path), tokenizer=args.tokenizer,
        num_prompts=args.num_prompts, seed=args.seed, input_len=args.input_len, output_len=args.output_len,
        num_groups=args.num_groups, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
        short_len=args.short_len, long_len=args.long_len, long_fraction=args.long_fraction)
    load = LoadConfig(request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed)
    return endpoint, workload, load, SloConfig(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)


def cmd_bench(args: argparse.Namespace) -> int:
    from deploy.bench import report

    if args.compare is not None:
        print(report.compare(*args.compare))
        return 0
    endpoint, workload, load, slo = configs_from_args(args)

    from deploy.bench.datasets import load_requests
    from deploy.bench.metrics import summarize
    from deploy.bench.runner import run_load
    from engine.tokenizer import Tokenizer

    requests = load_requests(workload, Tokenizer.from_model(workload.tokenizer))
    result = asyncio.run(run_load(requests, endpoint, load, progress=not args.no_progress))
    summary = summarize(result.records, result.duration_s, slo)
    errors = sorted({r.error for r in result.records if not r.success})
    for error in errors[:5]:
        logger.warning("failed requests: %s", error)
    if args.out is not None:
        from deploy.bench.plots import write_plots

        args.out.mkdir(parents=True, exist_ok=True)
        config = {name: dataclasses.asdict(c) for name, c in
                  (("endpoint", endpoint), ("workload", workload), ("load", load), ("slo", slo))}
        config["endpoint"].pop("api_key")   # results get shared; keys must not travel with them
        config["load"]["request_rate"] = str(load.request_rate)   # JSON has no inf
        report.write_results(args.out / "results.json", config, summary, result.records)
        write_plots(result.records, result.duration_s, args.out)
    if args.json:
        print(json.dumps(summary))
    else:
        print(report.render(summary))
        if errors:
            print(f"{summary['failed']} failed; first error: {errors[0]}", file=sys.stderr)
        if args.out is not None:
            print(f"results and plots in {args.out}", file=sys.stderr)
    return 0 if summary["completed"] else 1
