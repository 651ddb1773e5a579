"""Command-line flags generated from the config dataclasses, so flags map 1:1 onto fields.

Used by every entry point that builds an engine (`tandem generate`, the worker processes).
Pure Python.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

# Flags that users know under a second name from vLLM / SGLang.
_ALIASES = {"max_num_seqs": ["--max-running-requests"],
            "gpu_memory_utilization": ["--mem-fraction-static"]}
_HELP = {
    "model": "built-in model name, HF model directory, .gguf file or Hugging Face id (org/name; "
             "from the local HF cache, else downloaded once per node; HF_HUB_OFFLINE, HF_TOKEN apply)",
    "revision": "branch, tag or commit of a Hugging Face id",
    "download_dir": "HF cache directory for Hugging Face ids (default: HF_HUB_CACHE)",
    "dtype": "weights/activations dtype (auto: bfloat16 on CUDA and on CPUs with native bf16 "
             "(avx512_bf16/amx_bf16), float32 on other CPUs)",
    "device": "cpu, cuda or auto",
    "max_model_len": "longest prompt + output accepted (default: the model's context length)",
    "attention_backend": "auto (triton on CUDA; on CPU: cpu, or torch when its C kernels cannot be "
                         "compiled), cpu (C kernels over the paged cache, needs gcc), torch or triton",
    "block_size": "tokens per KV block",
    "kv_cache_memory": "bytes for the KV pool (CPU default 1 GiB)",
    "gpu_memory_utilization": "CUDA: fraction of device memory for weights + activations + KV",
    "num_gpu_blocks_override": "exact number of KV blocks",
    "enable_prefix_caching": "reuse cached prompt blocks",
    "shared_memory": "CPU: allocate the KV pool in /dev/shm so kvtransfer can map it",
    "max_num_seqs": "decode batch cap",
    "chunked_prefill_size": "prefill tokens per step (0 = auto: 512 on CPU, 2048 on CUDA)",
    "schedule_policy": "fcfs or lpm (longest prefix match first)",
    "schedule_conservativeness": "scales the future-token room reserved for running requests",
    "tensor_parallel_size": "ranks (processes, one per GPU) of one replica; must divide the model's "
                            "attention and KV heads",
    "tp_rank": "this process's tensor-parallel rank: 0 schedules and serves, > 0 follows rank 0",
    "dist_init_address": "host:port where rank 0 hosts the torch.distributed store (required when "
                         "--tensor-parallel-size > 1; the same on every rank)",
}


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--kebab-name`` flag per field of ``cls`` (booleans get ``--no-...``)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flags = ["--" + f.name.replace("_", "-")] + _ALIASES.get(f.name, [])
        tp = _base_type(hints[f.name])
        help_text = _HELP.get(f.name, "") + f" (default: {f.default})"
        if tp is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, type=tp, default=f.default, help=help_text)


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """Build ``cls`` from the parsed flags of its fields; raises ValueError when invalid."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


def config_to_args(config: Any, skip: tuple[str, ...] = (), changed_only: bool = False) -> list[str]:
    """The flags that ``add_config_args`` + ``config_from_args`` turn back into ``config``
    (for spawning a process with the same settings); ``changed_only``: only the fields that
    differ from their defaults."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in skip or value is None or (changed_only and value == f.default):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv
