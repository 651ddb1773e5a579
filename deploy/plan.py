"""`tandem plan`: how much KV cache, concurrency and max_model_len a deployment can afford.

Runs in the user's shell process. The arithmetic operators otherwise do by hand (FastDeploy's
FAQ: blocks x block_size tokens / tokens per request; vLLM's post-mortem: max_model_len = P99
prompt length + max_tokens), from the model's architecture alone — no weights are loaded.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.capacity import capacity_lines
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, resolve_chunked_prefill_size
from engine.math_utils import cdiv
from engine.models.arch import ArchConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Workload:
    """Request lengths: averages, or percentiles from a request log."""

    avg_input_len: float
    avg_output_len: float
    p99_input_len: int | None = None
    max_output_len: int | None = None
    num_requests: int = 0


@dataclass
class Plan:
    model: str
    architecture: str
    num_params: int                    # every weight the GPUs hold, each expert of an MoE model included
    num_active_params: int             # what one token runs through (less the experts it is not routed to)
    dtype: str
    tensor_parallel_size: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token: int            # per GPU (this rank's share of the KV heads)
    kv_budget_bytes: int
    activation_bytes: int
    num_blocks: int
    block_size: int
    kv_tokens: int
    max_model_len: int
    concurrency_at_max_model_len: int
    tokens_per_request: float
    concurrency_at_workload: int
    recommended_max_model_len: int | None
    capacity_lines: tuple[str, str]
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def read_workload(path: Path) -> Workload:
    """A JSONL request log: one object per line with ``prompt_len`` (or ``prompt_tokens``, or a
    ``prompt`` string counted in characters / 4) and ``max_tokens`` (or ``output_len``)."""
    inputs, outputs = [], []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if "prompt_len" in record or "prompt_tokens" in record:
                n_in = int(record.get("prompt_len", record.get("prompt_tokens")))
            else:
                n_in = math.ceil(len(record["prompt"]) / 4)
            n_out = int(record.get("max_tokens", record.get("output_len")))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: expected prompt_len (or prompt) and max_tokens: {exc}") from exc
        inputs.append(n_in)
        outputs.append(n_out)
    if not inputs:
        raise ValueError(f"{path} holds no requests")
    inputs.sort()
    p99 = inputs[min(len(inputs) - 1, int(len(inputs) * 0.99))]
    return Workload(sum(inputs) / len(inputs), sum(outputs) / len(outputs), p99, max(outputs), len(inputs))


def activation_estimate(arch: ArchConfig, chunked_prefill_size: int, max_num_seqs: int, itemsize: int,
                        tp: int) -> int:
    """A worst prefill step's activations plus float32 logits for a decode batch (an estimate; a
    CUDA worker measures the real peak with a profiling forward pass)."""
    mlp_features = arch.intermediate_size
    if arch.moe is not None:
        # Each token's rows go through top_k experts (and the shared one) side by side.
        routed = arch.moe.top_k * arch.moe.intermediate_size + arch.moe.shared_intermediate_size
        mlp_features = max(routed, arch.intermediate_size if arch.moe.dense_layers else 0)
    per_token = 3 * arch.hidden_size + (2 * mlp_features
                                        + (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim) // tp
    return chunked_prefill_size * per_token * itemsize + max_num_seqs * arch.vocab_size * 4


def make_plan(arch: ArchConfig, model: str, *, dtype: str, block_size: int, tensor_parallel_size: int,
              workload: Workload, memory_bytes: int | None, gpu_memory_utilization: float,
              kv_cache_memory: int | None, max_model_len: int | None, chunked_prefill_size: int,
              max_num_seqs: int, activation_bytes: int | None = None) -> Plan:
    tp = tensor_parallel_size
    chunked_prefill_size = resolve_chunked_prefill_size(chunked_prefill_size, on_cuda=memory_bytes is not None)
    if arch.num_kv_heads % tp:
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {arch.num_kv_heads} KV heads")
    itemsize = DTYPE_BYTES[dtype]
    weight_bytes = cdiv(arch.num_params * itemsize, tp)
    kv_per_token = arch.kv_bytes_per_token(itemsize) // tp
    warnings: list[str] = []
    if kv_cache_memory is not None or memory_bytes is None:
        # What a worker does with --kv-cache-memory (or on CPU by default): exactly that budget.
        budget = kv_cache_memory if kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_BYTES
        activations = 0
    else:
        activations = activation_bytes if activation_bytes is not None else activation_estimate(
            arch, chunked_prefill_size, max_num_seqs, itemsize, tp)
        usable = int(memory_bytes * gpu_memory_utilization)
        budget = usable - weight_bytes - activations
        if weight_bytes > usable:
            warnings.append(f"weights need {_gib(weight_bytes)} per GPU but only {_gib(usable)} is usable "
                            f"({gpu_memory_utilization:g} x {_gib(memory_bytes)}): raise "
                            f"--tensor-parallel-size or use a smaller dtype")
        budget = max(budget, 0)
    num_blocks = budget // (block_size * kv_per_token)
    kv_tokens = num_blocks * block_size
    max_len = max_model_len or arch.max_position_embeddings
    blocks_per_max = cdiv(max_len, block_size)
    tokens_per_request = workload.avg_input_len + workload.avg_output_len
    concurrency = int(num_blocks // max(1, math.ceil(tokens_per_request / block_size)))
    recommended = None
    if workload.p99_input_len is not None and workload.max_output_len is not None:
        recommended = workload.p99_input_len + workload.max_output_len
    if num_blocks < blocks_per_max:
        warnings.append(f"the KV pool holds {kv_tokens} tokens, less than one max_model_len={max_len} "
                        f"sequence: the worker will refuse to start; lower --max-model-len "
                        f"(recommended {recommended or 'P99 prompt + max_tokens'}) or give the KV cache more memory")
    elif concurrency < max_num_seqs:
        warnings.append(f"only ~{concurrency} requests of {tokens_per_request:.0f} tokens fit in the KV cache, "
                        f"fewer than --max-num-seqs {max_num_seqs}: decode batches will be small and requests "
                        f"will queue; give the KV cache more memory, use more replicas, or lower --max-num-seqs")
    if recommended is not None and recommended < max_len:
        warnings.append(f"max_model_len={max_len} exceeds what the request log needs ({recommended} = P99 prompt "
                        f"{workload.p99_input_len} + max_tokens {workload.max_output_len}); lowering it keeps "
                        "a single long request from reserving the whole pool")
    return Plan(model, arch.architecture, arch.num_params, arch.num_active_params, dtype, tp, weight_bytes,
                kv_per_token, budget, activations, num_blocks, block_size, kv_tokens, max_len,
                num_blocks // blocks_per_max, tokens_per_request, concurrency, recommended,
                capacity_lines(num_blocks, block_size, max_len), warnings)


def render(plan: Plan) -> str:
    active = ("" if plan.num_active_params == plan.num_params
              else f" ({plan.num_active_params / 1e9:.2f}B active per token)")
    lines = [
        f"model: {plan.model} ({plan.architecture}, {plan.num_params / 1e9:.2f}B params{active}, {plan.dtype}, "
        f"TP {plan.tensor_parallel_size})",
        f"weights per GPU: {_gib(plan.weight_bytes_per_gpu)}",
        f"KV bytes per token per GPU: {plan.kv_bytes_per_token}",
        f"KV budget per GPU: {_gib(plan.kv_budget_bytes)} (activation reserve {_gib(plan.activation_bytes)})",
        plan.capacity_lines[0],
        plan.capacity_lines[1],
        f"~{plan.concurrency_at_workload} concurrent requests at the workload's "
        f"{plan.tokens_per_request:.0f} tokens/request",
    ]
    if plan.recommended_max_model_len is not None:
        lines.append(f"recommended max_model_len: {plan.recommended_max_model_len} (P99 prompt + max_tokens)")
    lines += [f"WARNING: {w}" for w in plan.warnings]
    return "\n".join(lines)


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(float(lowered))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
