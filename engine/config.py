"""Frozen, validated configuration for the engine (runs in every worker process).

One dataclass per component; CLI flags map 1:1 onto these fields. Validation happens in
``__post_init__`` and raises ``ValueError`` with a message that says what to change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "smollm2-135m-instruct"
MAX_LOGPROBS = 20
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_POLICIES = ("fcfs", "lpm")


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when this CPU computes bf16 dot products natively (AVX512-BF16 or AMX-BF16)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, on_cuda: bool) -> str:
    """What ``--dtype auto`` means: bfloat16 on CUDA and on CPUs with native bf16, else float32
    (one rule for the engine, ``tandem plan`` and ``tandem serve``'s checks)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if on_cuda or cpu_has_native_bf16() else "float32"


# Prefill tokens per step when --chunked-prefill-size is 0 (auto). On CPU a prefill step is
# compute-bound from a few hundred tokens on, so a bigger step batches nothing more and only
# makes every prompt in it wait for the slowest: measured with `vllm bench serve` against `tandem
# serve` on 2 cores (16 streams, 256/128), 2048 gave TTFT p50 2.1 s and 279 output tok/s, 512
# 0.34 s and 333 tok/s (256: the same as 512, 1024: 0.81 s, 296 tok/s).
CPU_CHUNKED_PREFILL_SIZE = 512
CUDA_CHUNKED_PREFILL_SIZE = 2048


def resolve_chunked_prefill_size(size: int, on_cuda: bool) -> int:
    """What ``--chunked-prefill-size 0`` (the default) means on this device."""
    if size:
        return size
    return CUDA_CHUNKED_PREFILL_SIZE if on_cuda else CPU_CHUNKED_PREFILL_SIZE


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how to run them."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"          # auto = bfloat16 on CUDA and on CPUs with avx512_bf16/amx_bf16, else float32
    device: str = "auto"         # auto = cuda when available, else cpu
    max_model_len: int | None = None  # None = the model's own context length
    attention_backend: str = "auto"   # auto = triton on CUDA, cpu (C kernels; torch if they cannot build) on CPU

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model: a built-in name, an HF directory or a .gguf file")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {_DTYPES}")
        if self.device not in _DEVICES:
            raise ValueError(f"device={self.device!r} is not supported; use one of {_DEVICES}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(f"attention_backend={self.attention_backend!r}: use auto, cpu, torch or triton")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV pool geometry and sizing (DESIGN.md §4)."""

    block_size: int = 16
    kv_cache_memory: int | None = None        # bytes for the KV pool; wins over utilization
    gpu_memory_utilization: float = 0.9       # CUDA: fraction of device memory for weights+KV
    num_gpu_blocks_override: int | None = None  # exact number of blocks
    enable_prefix_caching: bool = True
    shared_memory: bool = True                # CPU: put the pool in /dev/shm for kvtransfer

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits (DESIGN.md §6)."""

    max_num_seqs: int = 64              # decode batch cap (--max-running-requests)
    chunked_prefill_size: int = 0       # prefill tokens per step; 0 = auto (512 on CPU, 2048 on CUDA)
    schedule_policy: str = "fcfs"       # fcfs | lpm (longest prefix match first)
    schedule_conservativeness: float = 1.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.chunked_prefill_size < 0:
            raise ValueError(f"chunked_prefill_size must be >= 1 (or 0 for auto), got {self.chunked_prefill_size}")
        if self.schedule_policy not in _POLICIES:
            raise ValueError(
                f"schedule_policy={self.schedule_policy!r} is not supported; use one of {_POLICIES}")
        if self.schedule_conservativeness <= 0:
            raise ValueError(
                f"schedule_conservativeness must be > 0, got {self.schedule_conservativeness}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism inside one replica: one process per rank (DESIGN.md §8).

    Rank 0 schedules and broadcasts each step; ranks > 0 follow. ``dist_init_address`` is the
    ``host:port`` where rank 0 hosts the torch.distributed TCPStore every rank joins.
    """

    tensor_parallel_size: int = 1
    tp_rank: int = 0
    dist_init_address: str = ""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 <= self.tp_rank < self.tensor_parallel_size:
            raise ValueError(f"tp_rank={self.tp_rank} is outside [0, {self.tensor_parallel_size}): "
                             f"give each of the tensor_parallel_size={self.tensor_parallel_size} ranks "
                             f"--tp-rank 0..{self.tensor_parallel_size - 1}")
        if self.tensor_parallel_size > 1 and not self.dist_init_address:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs --dist-init-address "
                             "host:port (where rank 0 hosts the torch.distributed store; the same on every rank)")
        if self.dist_init_address:
            host, sep, port = self.dist_init_address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_address={self.dist_init_address!r} is not host:port "
                                 "(e.g. 127.0.0.1:29500)")

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def dist_host(self) -> str:
        return self.dist_init_address.rpartition(":")[0]

    @property
    def dist_port(self) -> int:
        return int(self.dist_init_address.rpartition(":")[2])


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (OpenAI / vLLM semantics).

    ``top_k <= 0`` disables top-k; ``logprobs=None`` returns none, ``logprobs=k`` returns the
    sampled token's logprob plus the top ``k`` (0 <= k <= 20).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive count, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
