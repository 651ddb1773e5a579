"""Frozen, validated configuration for the engine (runs in every worker process).

One dataclass per component; CLI flags map 1:1 onto these fields. Validation happens in
``__post_init__`` and raises ``ValueError`` with a message that says what to change.
``check_sampling`` is the one home of the sampling range checks: SamplingParams runs it, and
so does the router process (this module imports no torch), so both refuse the same values.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, NoReturn

DEFAULT_MODEL = "smollm2-135m-instruct"


def flag(default: Any, help: str, **metadata: Any) -> Any:
    """A config field and its command-line help in one place (engine/cli_args.py reads
    ``help``, and ``choices`` when given, from the field's metadata)."""
    return field(default=default, metadata={"help": help, **metadata})
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_POLICIES = ("fcfs", "lpm")
ENGINES = ("torch", "sim")   # sim: engine/sim/, a simulated forward pass
LOAD_FORMATS = ("auto", "dummy")   # dummy: random weights of the checkpoint's shapes (vLLM's --load-format dummy)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open(cpuinfo) as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when this CPU computes bf16 dot products natively (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags(cpuinfo)
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_amx_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when this CPU has AMX tiles with bf16 (the AMX linears of engine/csrc/quant_linear.c)."""
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags(cpuinfo)


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

    model: str = flag(DEFAULT_MODEL, "built-in model name, HF model directory, .gguf file or Hugging Face id "
                      "(org/name; from the local HF cache, else downloaded once per node; HF_HUB_OFFLINE, "
                      "HF_TOKEN apply)")
    dtype: str = flag("auto", "weights/activations dtype (auto: bfloat16 on CUDA and on CPUs with native bf16 "
                      "(avx512_bf16/amx_bf16), float32 on other CPUs)")
    device: str = flag("auto", "cpu, cuda or auto (cuda when available)")
    max_model_len: int | None = flag(None, "longest prompt + output accepted (default: the model's context length)")
    attention_backend: str = flag("auto", "auto (triton on CUDA; on CPU: cpu, or torch when its C kernels cannot "
                                  "be compiled), cpu (C kernels over the paged cache, needs gcc), torch or triton")
    revision: str | None = flag(None, "branch, tag or commit of a Hugging Face id (default: main)")
    download_dir: str | None = flag(None, "HF cache directory for Hugging Face ids (default: HF_HUB_CACHE)")
    gguf_kernels: str = flag("auto", "GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q6_K weights on CPU: auto (decode steps read the "
                             "quantized blocks up to the batch size where that measured faster at load; needs "
                             "AVX-512 and TP 1) or off (dense weights only)", choices=("auto", "off"))
    load_format: str = flag("auto", "auto (the checkpoint's weights) or dummy (random weights of the checkpoint's "
                            "shapes, read from its config alone: an HF directory needs only config.json and the "
                            "tokenizer files; for measuring speed, e.g. a --engine sim profile for hardware "
                            "without the weights; the output is noise)", choices=LOAD_FORMATS)
    engine: str = flag("torch", "torch (run the model) or sim (simulated forward pass: each step sleeps the time "
                       "--sim-profile's latency model predicts and emits deterministic tokens; everything else is "
                       "real; README 'Simulated engine')", choices=ENGINES)
    sim_profile: str | None = flag(None, "--engine sim: a benchmarks/engine.py --json output file, or a shipped "
                                   "profile's name (engine/sim/profiles/); also given as --model sim:PROFILE")

    def __post_init__(self) -> None:
        self._resolve_sim()
        if not self.model:
            raise ValueError("model must name a model: a built-in name, an HF directory, a .gguf file "
                             "or a Hugging Face id (org/name)")
        if self.revision is not None and not self.revision.strip():
            raise ValueError("revision must be a branch, tag or commit; leave it unset for main")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {_DTYPES}")
        if self.device not in _DEVICES:
            raise ValueError(f"device={self.device!r} is not supported; use one of {_DEVICES}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.gguf_kernels not in ("auto", "off"):
            raise ValueError(f"gguf_kernels={self.gguf_kernels!r}: use auto or off")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r}: use one of {LOAD_FORMATS}")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(f"attention_backend={self.attention_backend!r}: use auto, cpu, torch or triton")

    def _resolve_sim(self) -> None:
        """One spelling of a simulated model everywhere: ``model`` = ``sim:PROFILE`` with
        ``engine`` = sim and ``sim_profile`` = PROFILE (an existing file as an absolute path)."""
        from engine.sim.arch import SIM_PREFIX, canonical_profile, sim_profile_of

        named = sim_profile_of(self.model)
        if named is not None:
            if self.sim_profile is not None and canonical_profile(self.sim_profile) != canonical_profile(named):
                raise ValueError(f"--model {self.model} and --sim-profile {self.sim_profile} name two profiles; "
                                 "give one")
            object.__setattr__(self, "engine", "sim")
            object.__setattr__(self, "sim_profile", named)
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r}: use one of {ENGINES}")
        if self.engine != "sim":
            if self.sim_profile is not None:
                raise ValueError("--sim-profile is for --engine sim")
            return
        if not self.sim_profile:
            raise ValueError("--engine sim needs --sim-profile FILE (benchmarks/engine.py --json output, or a "
                             "shipped profile's name)")
        if named is None and self.model != DEFAULT_MODEL:
            raise ValueError(f"--engine sim serves the tokenizer its profile names (its 'tokenizer' field), not "
                             f"--model {self.model}: leave --model out")
        profile = canonical_profile(self.sim_profile)
        object.__setattr__(self, "sim_profile", profile)
        object.__setattr__(self, "model", SIM_PREFIX + profile)


DEFAULT_MAX_TOKENS = 16   # output tokens when a request names none (OpenAI's completions default)
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30   # the KV pool of a CPU worker without --kv-cache-memory


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV pool geometry and sizing (docs/architecture.md#kv-cache)."""

    block_size: int = flag(16, "tokens per KV block")
    kv_cache_memory: int | None = flag(None, f"bytes for the KV pool; wins over --gpu-memory-utilization "
                                       f"(CPU default {DEFAULT_CPU_KV_CACHE_BYTES >> 30} GiB)")
    gpu_memory_utilization: float = flag(0.9, "CUDA: fraction of device memory for weights + activations + KV")
    num_gpu_blocks_override: int | None = flag(None, "exact number of KV blocks")
    enable_prefix_caching: bool = flag(True, "reuse cached prompt blocks")
    shared_memory: bool = flag(True, "CPU: allocate the KV pool in /dev/shm so kvtransfer can map it")

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
    """Continuous-batching limits (docs/architecture.md#scheduling-and-its-knobs)."""

    max_num_seqs: int = flag(64, "decode batch cap")
    chunked_prefill_size: int = flag(0, f"tokens per step, decodes included; prefill chunks fill the rest, at least "
                                     f"a quarter (0 = auto: {CPU_CHUNKED_PREFILL_SIZE} on CPU, "
                                     f"{CUDA_CHUNKED_PREFILL_SIZE} on CUDA)")
    schedule_policy: str = flag("fcfs", "fcfs or lpm (longest prefix match first)")
    schedule_conservativeness: float = flag(1.0, "scales the future-token room reserved for running requests")

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
    """Tensor parallelism inside one replica: one process per rank (docs/architecture.md#tensor-parallelism).

    Rank 0 schedules and broadcasts each step; ranks > 0 follow. ``dist_init_address`` is the
    ``host:port`` where rank 0 hosts the torch.distributed TCPStore every rank joins.
    """

    tensor_parallel_size: int = flag(1, "ranks (processes, one per GPU) of one replica; must divide the "
                                     "model's attention and KV heads")
    tp_rank: int = flag(0, "this process's tensor-parallel rank: 0 schedules and serves, > 0 follows rank 0")
    dist_init_address: str = flag("", "host:port where rank 0 hosts the torch.distributed store (required "
                                  "when --tensor-parallel-size > 1; the same on every rank)")

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


class InvalidSamplingError(ValueError):
    """A sampling value out of range; ``param`` names the field (OpenAI's error ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 128
MAX_CACHE_SALT_CHARS = 256   # SamplingParams.cache_salt: a tenant key; longer adds nothing
MIN_TEMPERATURE = 1e-2          # 0 < temperature below this is raised to it (logits / tiny overflow)
REPETITION_PENALTY_RANGE = (1e-2, 1e2)   # positive logits are divided by it: a tiny one overflows
_FLOAT32_MAX = 3.4028234663852886e38
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1


def _invalid(param: str, message: str) -> NoReturn:
    raise InvalidSamplingError(param, f"{param} must {message}")


def _finite32(value: float) -> bool:
    # The engine computes in float32: a finite double beyond its range becomes inf there.
    return math.isfinite(value) and abs(value) <= _FLOAT32_MAX


def clamp_temperature(temperature: float) -> float:
    """vLLM's rule: a positive temperature below MIN_TEMPERATURE (denormals included) samples
    as MIN_TEMPERATURE, since dividing logits by it would overflow to inf."""
    return MIN_TEMPERATURE if 0.0 < temperature < MIN_TEMPERATURE else temperature


def check_sampling(*, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                   min_p: float | None = None, repetition_penalty: float | None = None,
                   presence_penalty: float | None = None, frequency_penalty: float | None = None,
                   seed: int | None = None, max_tokens: int | None = None, logprobs: int | None = None,
                   stop_token_ids=(), vocab_size: int | None = None) -> None:
    """Every range check on sampling values, in one place for the engine and the router (which
    imports this torch-free module). None means "not given". Raises InvalidSamplingError whose
    message starts with ``"<field> must"``."""
    # Each message is formatted only when its check fails: the router runs this on every request.
    if temperature is not None:
        if not temperature >= 0.0:   # NaN fails too
            _invalid("temperature", f"be >= 0, got {temperature}")
        if not _finite32(temperature):
            _invalid("temperature", f"be a finite float32, got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        _invalid("top_p", f"be in (0, 1], got {top_p}")
    if top_k is not None and not -1 <= top_k <= _INT32_MAX:
        _invalid("top_k", f"be -1, 0 (disabled) or a positive count, got {top_k}")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        _invalid("min_p", f"be in [0, 1], got {min_p}")
    if repetition_penalty is not None:
        low, high = REPETITION_PENALTY_RANGE
        if not low <= repetition_penalty <= high:
            _invalid("repetition_penalty", f"be in [{low}, {high}], got {repetition_penalty}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value is not None and not -2.0 <= value <= 2.0:
            _invalid(name, f"be in [-2, 2], got {value}")
    if seed is not None and not 0 <= seed <= _INT64_MAX:
        _invalid("seed", f"be in [0, 2**63), got {seed}")
    if max_tokens is not None:
        if not max_tokens >= 1:
            _invalid("max_tokens", f"be >= 1, got {max_tokens}")
        if not max_tokens <= _INT32_MAX:
            _invalid("max_tokens", f"be < 2**31, got {max_tokens}")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        _invalid("logprobs", f"be in [0, {MAX_LOGPROBS}], got {logprobs}")
    if stop_token_ids:
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _invalid("stop_token_ids", f"hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}")
        limit = _INT64_MAX + 1 if vocab_size is None else vocab_size
        bad = next((t for t in stop_token_ids if not 0 <= t < limit), None)
        if bad is not None:
            _invalid("stop_token_ids", f"be token ids in [0, {limit}), got {bad}")


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_SPEC_CHARS = 1 << 18   # a schema, regex, choice list or grammar, as text
MAX_CHOICES = 1024


def check_structured(kind: str, spec: str) -> None:
    """What can be checked about a structured-output constraint without its grammar engine
    (the router runs this; the workers then compile it with xgrammar, which is the final word).
    ValueError saying what is wrong."""
    if kind not in STRUCTURED_KINDS:
        raise ValueError(f"structured output kind {kind!r} is not supported; use one of {STRUCTURED_KINDS}")
    if len(spec) > MAX_STRUCTURED_SPEC_CHARS:
        raise ValueError(f"the {kind} is {len(spec)} characters, more than {MAX_STRUCTURED_SPEC_CHARS}")
    if kind == "json_object":
        if spec:
            raise ValueError("json_object takes no schema; use json_schema to give one")
        return
    if not spec:
        raise ValueError(f"the {kind} is empty")
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}"[:300]) from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
    elif kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError:
            choices = None
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"choice holds {len(choices)} strings, more than {MAX_CHOICES}")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow; engine.structured compiles it (xgrammar) and masks
    every sampled token with it, on the prefill worker (first token) and the decode worker.

    ``spec`` by ``kind``: json_schema: the schema as JSON text; json_object: empty (any JSON
    object); regex: the pattern; choice: a JSON array of the allowed strings; grammar: EBNF
    (xgrammar's dialect). A resumed request's matcher first accepts the output an earlier attempt
    generated (``SamplingParams.num_resumed_tokens``).
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        check_structured(self.kind, self.spec)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (OpenAI / vLLM semantics).

    ``top_k <= 0`` disables top-k; ``logprobs=None`` returns none, ``logprobs=k`` returns the
    sampled token's logprob plus the top ``k`` (0 <= k <= 20). With ``structured`` the logprobs
    are those of the grammar-masked logits (as in vLLM, where the mask comes before the sampler).
    ``num_resumed_tokens``: the prompt's last N tokens are output an earlier attempt of this request
    generated (the router's failover re-sends prompt + output); the grammar matcher accepts them
    first, a seeded generator skips their draws and frequency/presence penalties count them as
    output, so the stream goes on as the first attempt's would have.
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
    max_tokens: int = DEFAULT_MAX_TOKENS
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredOutput | None = None   # the output follows this grammar
    cache_salt: str = ""   # prefix-cache separation: only requests with the same salt share blocks
    num_resumed_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_resumed_tokens < 0:
            raise ValueError(f"num_resumed_tokens must be >= 0, got {self.num_resumed_tokens}")
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt is {len(self.cache_salt)} characters, more than {MAX_CACHE_SALT_CHARS}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        check_sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                       repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                       frequency_penalty=self.frequency_penalty, seed=self.seed, max_tokens=self.max_tokens,
                       logprobs=self.logprobs, stop_token_ids=self.stop_token_ids)
        object.__setattr__(self, "temperature", clamp_temperature(self.temperature))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
