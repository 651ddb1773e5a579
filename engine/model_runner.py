"""Model runner: loads the weights, sizes and owns the KV pool, runs one flattened forward.

Runs in the engine thread of a worker. It never decides policy: the scheduler says which
tokens run; the runner turns them into tensors (ids, positions, slots, block tables), runs the
model, and returns float32 logits for the rows that sample.

Under tensor parallelism every rank has a runner holding its shard of the weights and a KV pool
of its own KV heads (same block count on every rank). Rank 0's ``execute`` broadcasts the
step's host-side inputs (:class:`StepInputs`, msgpack) before running it; a follower runs the
same forward from them with ``execute_step``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from engine.attention.metadata import AttentionMetadata
from engine.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    resolve_chunked_prefill_size,
    resolve_dtype,
)
from engine.kv_cache import KVPool, KVPoolShape, capacity_lines
from engine.loader import Checkpoint, resolve_model
from engine.math_utils import cdiv
from engine.models import llama, moe, quant_linear
from engine.models.arch import ArchConfig
from engine.models.layers import PackedLinear, RotaryEmbedding, TensorParallel, can_pack_linear
from engine.models.llama import LlamaForCausalLM, check_tensor_parallel
from engine.scheduler import ScheduledBatch
from engine.tp.group import STEP, Leader, TPGroup

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ForwardInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor   # rows of the hidden states whose logits are needed


@dataclass(frozen=True)
class StepInputs:
    """One step's forward inputs as plain host lists: what rank 0 broadcasts to followers."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    prefill_tables: list[list[int]]
    decode_lens: list[int]
    decode_tables: list[list[int]]
    sample_rows: list[int]

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> StepInputs:
        return cls(**{name: body[name] for name in cls.__dataclass_fields__})


def pick_device(config: ModelConfig, tp_rank: int = 0) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use --device cpu")
    # One GPU per rank: rank r takes visible device r (or device 0 when the launcher gave each
    # rank process its own CUDA_VISIBLE_DEVICES).
    return torch.device("cuda", tp_rank % torch.cuda.device_count())


def pick_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on CPUs with native bf16, float32 on other CPUs."""
    return _DTYPES[resolve_dtype(config.dtype, device.type == "cuda")]


def attention_backend(config: ModelConfig, device: torch.device) -> ModuleType:
    name = config.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend='triton' needs a CUDA device; use 'cpu' or 'torch' on CPU")
        from engine.attention import triton_backend
        return triton_backend
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention_backend='cpu' needs --device cpu; use 'triton' or 'torch' on CUDA")
        from engine.attention import cpu_backend
        try:
            cpu_backend.load_kernels()  # compiles on first use; KernelBuildError if it cannot
            return cpu_backend
        except cpu_backend.KernelBuildError as e:
            if config.attention_backend == "cpu":
                raise
            logger.warning("CPU attention kernels unavailable, using the slower torch backend: %s", e)
    from engine.attention import torch_backend
    return torch_backend


def _from_cache(path: Path | None) -> str:
    return f"; timed earlier, from {path} (delete it to time again)" if path is not None else ""


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 max_num_batched_tokens: int, parallel: ParallelConfig = ParallelConfig()) -> None:
        self.parallel = parallel
        self.device = pick_device(model_config, parallel.tp_rank)
        self.dtype = pick_dtype(model_config, self.device)
        self.max_num_batched_tokens = resolve_chunked_prefill_size(max_num_batched_tokens, self.device.type == "cuda")
        checkpoint = Checkpoint(resolve_model(model_config.model, model_config.revision, model_config.download_dir))
        self.source = checkpoint.source
        self.arch: ArchConfig = checkpoint.arch
        check_tensor_parallel(self.arch, parallel.tensor_parallel_size)  # before waiting for peers
        self.max_model_len = self._max_model_len(model_config.max_model_len)
        self.block_size = cache_config.block_size
        self.group: TPGroup | None = None
        self.leader: Leader | None = None
        self.kv_pool: KVPool | None = None
        self._untuned: list[PackedLinear] = []   # GGUF-backed linears tune_kernels has not timed
        self._tuned = False
        try:
            self._start(model_config, cache_config, self.max_num_batched_tokens, checkpoint)
        except BaseException:
            self.close()
            raise

    def _start(self, model_config: ModelConfig, cache_config: CacheConfig, max_num_batched_tokens: int,
               checkpoint: Checkpoint) -> None:
        tp = TensorParallel()
        if self.parallel.tensor_parallel_size > 1:
            self.group = TPGroup(self.parallel, self.device)
            tp = TensorParallel(self.group.rank, self.group.size, self.group.all_reduce)
        started = time.perf_counter()
        self.model = self._load_model(checkpoint, attention_backend(model_config, self.device), tp,
                                      model_config.gguf_kernels, dummy=model_config.load_format == "dummy")
        logger.info("loaded %s (%s, %.1fM params, %s, TP rank %d of %d) in %.1f s", self.source.path,
                    self.arch.architecture, self.arch.num_params / 1e6, self.dtype, tp.rank, tp.size,
                    time.perf_counter() - started)
        self.layout = KVPoolShape(self.arch.num_layers, tp.split(self.arch.num_kv_heads), self.arch.head_dim,
                               self.block_size, self.dtype)
        num_blocks = self._num_kv_blocks(cache_config, max_num_batched_tokens)
        if self.group is not None:
            # Every rank must index the same blocks: the smallest pool any rank can hold wins.
            num_blocks = self.group.all_min([num_blocks])[0]
        if num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV pool holds {num_blocks} blocks x {self.block_size} tokens = "
                f"{num_blocks * self.block_size} tokens, less than one max_model_len={self.max_model_len} "
                "sequence; give it more memory (--kv-cache-memory / --gpu-memory-utilization / "
                "--num-gpu-blocks-override) or lower --max-model-len")
        self.kv_pool = KVPool(self.layout, num_blocks, self.device,
                              shared_memory=cache_config.shared_memory)
        self.kv_caches = self.kv_pool.layer_caches()
        for line in capacity_lines(num_blocks, self.block_size, self.max_model_len):
            logger.info(line)
        if self.group is not None:
            self.group.all_min([0])  # every rank has its pool: followers now enter their loop
            if self.group.is_leader:
                self.leader = Leader(self.group)
                self.leader.start_heartbeat()

    def _max_model_len(self, asked: int | None) -> int:
        window = self.arch.sliding_window
        if window is None or (asked or self.arch.max_position_embeddings) <= window:
            return asked or self.arch.max_position_embeddings
        # Attention here is full-context; within the window that is exactly sliding-window
        # attention, beyond it the outputs would silently differ from the model's.
        if asked is not None:
            raise ValueError(f"max_model_len={asked} exceeds the model's sliding_window={window}; "
                             f"Tandem has no sliding-window attention yet: use --max-model-len {window} or less")
        logger.warning("capping max_model_len at the model's sliding_window=%d (no sliding-window attention yet)",
                       window)
        return window

    @property
    def num_blocks(self) -> int:
        assert self.kv_pool is not None, "the KV pool is allocated in __init__"
        return self.kv_pool.num_blocks

    def _load_model(self, checkpoint: Checkpoint, backend: ModuleType, tp: TensorParallel,
                    gguf_kernels: str = "auto", dummy: bool = False) -> LlamaForCausalLM:
        cls = {**llama.MODEL_CLASSES, **moe.MODEL_CLASSES}[self.arch.architecture]
        max_positions = max(self.max_model_len, self.arch.max_position_embeddings)
        rotary = RotaryEmbedding(self.arch.head_dim, max_positions, self.arch.rope_theta,
                                 self.arch.rope_scaling, self.device, checkpoint.rope_freq_factors())
        # Built on the meta device: parameters get their storage from the checkpoint itself.
        with torch.device("meta"):
            model = cls(self.arch, backend, rotary, tp)
        if dummy:
            model.init_dummy_weights(self.dtype, self.device)   # the checkpoint's weights are never read
        else:
            model.load_weights(checkpoint.weights(), self.dtype, self.device)
        if can_pack_linear(self.device, self.dtype):
            model.pack_for_cpu()
            if (gguf_kernels == "auto" and checkpoint.gguf is not None and not dummy
                    and quant_linear.load() is not None):
                self._use_quantized(model, checkpoint)
        return model.eval()

    def _use_quantized(self, model: LlamaForCausalLM, checkpoint: Checkpoint) -> None:
        """Attach the GGUF blocks to the packed linears; ``tune_kernels`` decides how far decode
        steps use them."""
        self._untuned = model.attach_quantized(checkpoint.quantized_weights())

    def tune_kernels(self) -> None:
        """Choose, by timing, how far decode steps use the faster-at-small-batches linears: the
        AMX kernel on the row-major bf16 weights (``PackedLinear.rows``), then the GGUF blocks
        (against whichever of the two dense paths won). Once, on the calling thread with its
        torch threads: the first step calls it, so it times the thread (and OpenMP team) that
        runs the steps; a worker calls it on its engine thread before it says it is ready. Each
        answer is kept in the tuning cache (``quant_linear.tuned_max_batch``): a worker that
        starts again on this machine with the same model, dtype and threads reads it. Timed
        where a worker builds its engine, on one thread (worker/loop.py), the compute-bound
        blocks lost to the cache-bound dense weights even at batch 1 (SmolLM2 on 2 cores: 36.6
        vs 27.4 ms), so served decode never read them."""
        if self._tuned:
            return
        self._tuned = True
        threads = torch.get_num_threads()
        rows = [m for m in self.model.modules() if isinstance(m, PackedLinear) and m.rows is not None]
        if rows:
            max_batch, timings, cached = quant_linear.tuned_max_batch(
                "amx-rows", rows, self.dtype, candidate=lambda lin, x: lin.rows_forward(x))
            measured = ", ".join(f"batch {b}: {a:.1f} vs {d:.1f} ms" for b, (a, d) in timings.items())
            for lin in rows:
                lin.rows_max_batch = max_batch
                if max_batch == 0:
                    lin.rows = None   # slower even at batch 1: do not keep a second copy
            logger.info("AMX bf16 rows: %s (%d threads; AMX rows vs oneDNN packed, %d linears: %s)%s",
                        f"steps of up to {max_batch} tokens" if max_batch else "not used", threads, len(rows),
                        measured, _from_cache(cached))
        linears, self._untuned = self._untuned, []
        if not linears:
            return
        max_batch, timings, cached = quant_linear.tuned_max_batch(
            "gguf-blocks", linears, self.dtype, baseline=lambda lin, x: lin.unquantized_forward(x))
        measured = ", ".join(f"batch {b}: {q:.1f} vs {d:.1f} ms" for b, (q, d) in timings.items())
        blocks = [lin.quant for lin in linears if lin.quant is not None]   # every one: attach_quantized set them
        types = ", ".join(sorted({quant.name for quant in blocks}))
        if max_batch == 0:
            for lin in linears:
                lin.quant = None   # slower here even at batch 1: keep only the dense weights
            logger.info("GGUF %s blocks: not used, the dense weights were faster (%d threads; quantized vs dense, "
                        "%d linears: %s)%s", types, threads, len(linears), measured, _from_cache(cached))
            return
        for lin in linears:
            lin.quant_max_batch = max_batch
            if lin.rows is not None and lin.rows_max_batch <= max_batch:
                lin.rows, lin.rows_max_batch = None, 0   # the blocks cover every step the rows would
        logger.info("GGUF %s blocks: steps of up to %d tokens read %d linears' quantized weights (%.0f MB "
                    "beside %.0f MB dense; %d threads; quantized vs dense: %s)%s", types, max_batch, len(linears),
                    sum(quant.data.numel() for quant in blocks) / 1e6,
                    sum(lin.in_features * lin.out_features for lin in linears) * self.dtype.itemsize / 1e6,
                    threads, measured, _from_cache(cached))

    def _num_kv_blocks(self, cache_config: CacheConfig, max_num_batched_tokens: int) -> int:
        if cache_config.num_gpu_blocks_override is not None:
            return cache_config.num_gpu_blocks_override
        per_block = self.layout.bytes_per_block
        if cache_config.kv_cache_memory is not None:
            return cache_config.kv_cache_memory // per_block
        if self.device.type == "cpu":
            return DEFAULT_CPU_KV_CACHE_BYTES // per_block
        return self._profile_cuda_blocks(cache_config.gpu_memory_utilization, max_num_batched_tokens)

    def _profile_cuda_blocks(self, utilization: float, num_tokens: int) -> int:
        """Blocks that fit in ``utilization`` of the device after a worst-case forward pass."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(num_tokens, self.max_model_len)
        probe = KVPool(self.layout, cdiv(num_tokens, self.block_size), self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        inputs = self._prepare_prefill_probe(ids)
        with torch.inference_mode():
            self.model.compute_logits(self.model(ids, inputs.positions, probe.layer_caches(), inputs.meta)[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del probe
        total = torch.cuda.get_device_properties(self.device).total_memory
        available = int(total * utilization) - peak
        logger.info("memory profiling: total %.2f GiB, peak during forward %.2f GiB, KV budget %.2f GiB",
                    total / 2**30, peak / 2**30, max(available, 0) / 2**30)
        if available <= 0:
            raise ValueError(f"weights and activations take {peak / 2**30:.2f} GiB, more than "
                             f"gpu_memory_utilization={utilization} of {total / 2**30:.2f} GiB; "
                             "raise --gpu-memory-utilization or lower --chunked-prefill-size")
        return available // self.layout.bytes_per_block

    def _prepare_prefill_probe(self, ids: torch.Tensor) -> ForwardInputs:
        n = ids.shape[0]
        table = list(range(cdiv(n, self.block_size)))
        return self.to_device(StepInputs([0] * n, list(range(n)), list(range(n)), [0, n], [n], [table],
                                         [], [], [n - 1]))

    # -- one step ------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> ForwardInputs:
        return self.to_device(self.host_inputs(batch))

    def host_inputs(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for seq, num_new in batch.prefills:
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids += seq.all_token_ids[start:end]
            positions += range(start, end)
            table = seq.block_ids
            # slot = block_id * block_size + offset within the block
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
        prefill_tables = [list(s.block_ids) for s, _ in batch.prefills]
        decode_lens: list[int] = []
        for seq in batch.decodes:
            p = seq.num_tokens - 1
            input_ids.append(seq.output_token_ids[-1] if seq.output_token_ids else seq.prompt_token_ids[-1])
            positions.append(p)
            slots.append(seq.block_ids[p // bs] * bs + p % bs)
            decode_lens.append(p + 1)
            sample_rows.append(len(input_ids) - 1)
        decode_tables = [list(s.block_ids) for s in batch.decodes]
        return StepInputs(input_ids, positions, slots, query_start_loc, seq_lens, prefill_tables,
                          decode_lens, decode_tables, sample_rows)

    @staticmethod
    def _block_table(tables: list[list[int]]) -> torch.Tensor:
        if not tables:
            return torch.zeros(0, 1, dtype=torch.int32)
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def to_device(self, step: StepInputs) -> ForwardInputs:
        dev = self.device
        query_start_loc, seq_lens, decode_lens = step.query_start_loc, step.seq_lens, step.decode_lens
        prefill_tables, decode_tables = self._block_table(step.prefill_tables), self._block_table(step.decode_tables)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=tensor(step.slots, torch.long),
            num_prefills=len(seq_lens),
            num_prefill_tokens=query_start_loc[-1],
            query_start_loc=tensor(query_start_loc, torch.int32),
            prefill_seq_lens=tensor(seq_lens, torch.int32),
            prefill_block_tables=prefill_tables.to(dev),
            decode_seq_lens=tensor(decode_lens, torch.int32),
            decode_block_tables=decode_tables.to(dev),
            query_start_loc_host=tuple(query_start_loc),
            prefill_seq_lens_host=tuple(seq_lens),
            max_decode_seq_len=max(decode_lens, default=0),
        )
        return ForwardInputs(tensor(step.input_ids, torch.long), tensor(step.positions, torch.long), meta,
                             tensor(step.sample_rows, torch.long))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, after_layer: Callable[[int], None] | None = None,
                extra: dict[str, Any] | None = None) -> torch.Tensor:
        """Run one step; float32 logits ``[num_sampling_seqs, vocab]`` in batch order.

        With followers, the step (and ``extra``, a msgpack-able dict for their role's
        ``after_layer``) is broadcast first and the whole forward runs as one transaction.
        """
        if not self._tuned:
            self.tune_kernels()
        step = self.host_inputs(batch)
        inputs = self.to_device(step)
        if self.leader is None:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, after_layer)
            return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
        with self.leader.transaction() as group:
            group.send(STEP, {"inputs": step.to_wire(), "extra": extra or {}})
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, after_layer)
            return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))

    @torch.inference_mode()
    def execute_step(self, step: StepInputs, after_layer: Callable[[int], None] | None = None) -> None:
        """A follower's part of rank 0's step: the same forward on this rank's shard (its KV
        heads land in its own pool; the logits are rank 0's to compute)."""
        if not self._tuned:
            self.tune_kernels()
        inputs = self.to_device(step)
        self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, after_layer)

    def close(self) -> None:
        if self.leader is not None:
            self.leader.stop()   # followers leave their loops
            self.leader = None
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.kv_pool is not None:
            self.kv_pool.close()
