"""The `tandem` command line (runs in the user's shell process).

Subcommands:
  generate   run the in-process engine on prompts and print the completions
  plan       KV cache, concurrency and max_model_len a deployment can afford (no weights loaded)
  bench      load-test a serving endpoint (OpenAI-compatible or Tandem gRPC) with plots
  serve      router + prefill/decode workers on Ray (a local Ray instance when none runs)
  status     the deployment's router and workers
  scale      set prefill/decode replicas live (drains the ones it removes)
  down       stop the deployment
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from engine.cli_args import add_config_args, config_from_args
from engine.config import CacheConfig, ModelConfig, ParallelConfig, SamplingParams, SchedulerConfig, resolve_dtype

logger = logging.getLogger(__name__)


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions in-process (colocated engine)",
                       description="Generate completions with the in-process engine.")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="prompt text (repeat for several)")
    prompts.add_argument("--prompt-file", type=Path, help="file with one prompt per line")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as one user message with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="return the sampled token's logprob and the top K (0-20)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--log-level", default="INFO")
    add_config_args(p, ModelConfig)
    add_config_args(p, CacheConfig)
    add_config_args(p, SchedulerConfig)
    add_config_args(p, ParallelConfig, skip=("tp_rank", "dist_init_address"))
    p.set_defaults(func=_cmd_generate)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return args.prompt
    try:
        lines = args.prompt_file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --prompt-file {args.prompt_file}: {exc}") from exc
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"--prompt-file {args.prompt_file} holds no prompts")
    return prompts


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM  # torch is imported only by commands that need it

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                            logprobs=args.logprobs)
    prompts = _read_prompts(args)
    llm = LLM.from_configs(config_from_args(ModelConfig, args), config_from_args(CacheConfig, args),
                           config_from_args(SchedulerConfig, args),
                           tensor_parallel_size=args.tensor_parallel_size)
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    finally:
        llm.close()
    for out in outputs:
        if args.json:
            record = out.to_json()
            if out.logprobs is not None:
                record["logprobs"] = [{str(t): lp for t, lp in step.items()} for step in out.logprobs]
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            print(out.text, flush=True)
    return 0


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="capacity answers before OOM: KV blocks, concurrency, max_model_len",
                       description="Capacity arithmetic from the model's architecture (no weights loaded).")
    p.add_argument("--model", default=ModelConfig.model,
                   help="built-in name, HF directory, .gguf file or Hugging Face id (org/name)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a Hugging Face id")
    p.add_argument("--download-dir", default=None,
                   help="HF cache directory for Hugging Face ids (default: HF_HUB_CACHE)")
    p.add_argument("--memory", default=None,
                   help="device memory per GPU, e.g. 80GB or 80GiB, or 'auto' (this machine's CUDA device); "
                        "unset: a CPU worker, whose KV pool is --kv-cache-memory (default 1 GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization)
    p.add_argument("--kv-cache-memory", default=None, help="exact KV pool bytes per worker (e.g. 4GiB)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="auto: bfloat16 with --memory (a GPU) or on CPUs with native bf16, else float32")
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--chunked-prefill-size", type=int, default=SchedulerConfig.chunked_prefill_size)
    p.add_argument("--activation-memory", default=None, help="override the activation reserve estimate")
    p.add_argument("--input-len", type=float, default=1024, help="average prompt tokens")
    p.add_argument("--output-len", type=float, default=256, help="average output tokens")
    p.add_argument("--request-log", type=Path, default=None,
                   help="JSONL log, one request per line with prompt_len (or prompt) and max_tokens")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plan, log_level="WARNING")


def _cmd_plan(args: argparse.Namespace) -> int:
    from deploy.plan import Workload, make_plan, parse_bytes, read_workload, render
    from engine.model_source import load_arch, resolve_model

    if args.tensor_parallel_size < 1 or args.block_size < 1:
        raise ValueError("--tensor-parallel-size and --block-size must be >= 1")
    memory = args.memory
    if memory == "auto":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--memory auto needs a CUDA device; give a size such as 80GB")
        memory = torch.cuda.get_device_properties(0).total_memory
    elif memory is not None:
        memory = parse_bytes(memory)
    dtype = resolve_dtype(args.dtype, on_cuda=memory is not None)
    workload = (read_workload(args.request_log) if args.request_log is not None
                else Workload(args.input_len, args.output_len))
    source = resolve_model(args.model, args.revision, args.download_dir)
    plan = make_plan(load_arch(source), args.model, dtype=dtype, block_size=args.block_size,
                     tensor_parallel_size=args.tensor_parallel_size, workload=workload, memory_bytes=memory,
                     gpu_memory_utilization=args.gpu_memory_utilization,
                     kv_cache_memory=None if args.kv_cache_memory is None else parse_bytes(args.kv_cache_memory),
                     max_model_len=args.max_model_len, chunked_prefill_size=args.chunked_prefill_size,
                     max_num_seqs=args.max_num_seqs,
                     activation_bytes=None if args.activation_memory is None else parse_bytes(args.activation_memory))
    print(plan.to_json() if args.json else render(plan))
    return 0


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from deploy.bench.cli import add_bench_parser

    add_bench_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _plan_parser(sub)
    _bench_parser(sub)
    from deploy.serve import add_parsers

    add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
