"""Fixtures for the worker tests: the tiny checkpoint, worker processes, references, and the
in-process P/D twin (``pd_twin``: the real role loops on two engines, no processes).

The tiny random-weight Llama of tests/models.py (SmolLM2 tokenizer beside it) serves
every test but the SmolLM2 one. Workers run as real processes on one torch thread each (the
machine has 2 cores shared by two workers and pytest) and are always stopped at teardown; a
worker's stderr is printed at teardown, which pytest shows only for a failed test.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import kvtransfer
from decode_worker.worker import DecodeJob, DecodeLoop
from engine.config import CacheConfig, ModelConfig, SamplingParams, SchedulerConfig
from engine.llm_engine import LLMEngine
from prefill_worker.worker import Destination, PrefillLoop
from tests.workers.harness import BLOCK_SIZE, REFERENCE_BLOCKS, Worker, pool_flags, start_pair
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics


@pytest.fixture(scope="session")
def tiny_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def _spawner(log_dir: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def spawn(role: str, model: Path, *flags: str, name: str | None = None, wait: bool = True) -> Worker:
        worker = Worker(role, model, list(flags), log_dir, name or f"{role}-{len(started)}", wait=wait)
        started.append(worker)
        return worker

    yield spawn
    for worker in started:
        worker.stop()
    for worker in started:
        print(f"----- {worker.stderr_path.name} (rc={worker.proc.returncode}) -----")
        print(worker.stderr_path.read_text(errors="replace")[-6000:])


@pytest.fixture
def spawn(tmp_path) -> Iterator[Callable[..., Worker]]:
    """``spawn(role, model_dir, *flags)`` -> a ready Worker (``wait=False``: just started),
    stopped after the test."""
    yield from _spawner(tmp_path)


@pytest.fixture(scope="module")
def spawn_module(tmp_path_factory) -> Iterator[Callable[..., Worker]]:
    """Like ``spawn``, for workers shared by a whole module."""
    yield from _spawner(tmp_path_factory.mktemp("workers"))


@pytest.fixture(scope="package")
def shared_pair(tmp_path_factory, tiny_dir) -> Iterator[tuple[Worker, Worker]]:
    """A prefill and a decode worker process on the tiny Llama (256-block pools, the shm backend,
    a log line a second), started once for the modules of this folder that need no flags of
    their own (a pair takes ~8 s to start on 2 cores) and stopped when the folder is done, so no
    other folder's check for leftover worker processes sees them. Take it through ``pd_pair``."""
    for spawn in _spawner(tmp_path_factory.mktemp("workers-shared")):
        yield start_pair(spawn, tiny_dir, *pool_flags(), "--kv-backend", "shm", "--log-interval-s", "1",
                         names=("prefill-shared", "decode-shared"))


@pytest.fixture(scope="module")
def pd_pair(shared_pair) -> Iterator[tuple[Worker, Worker]]:
    """The session's shared prefill/decode pair, for one module; both must be idle when it ends,
    so the next module starts from nothing in flight."""
    from tests.workers.harness import wait_idle

    yield shared_pair
    wait_idle(*shared_pair)


@pytest.fixture
def pd_twin(tiny_model_dir):
    """``pd_twin(**options)`` -> (PrefillLoop, DecodeLoop): the in-process twin of a prefill/decode
    pair, two engines on the fake kvtransfer backend, no processes and no gRPC; stopped afterwards."""
    made = []

    def make(decode_blocks: int = 64, chunked_prefill_size: int = 2048, max_model_len: int = 128,
             device: str = "cpu", model: str = "llama", kv_lease_s: float = 30.0):
        model_dir = str(tiny_model_dir(model))

        def engine(keep: bool, blocks: int) -> LLMEngine:
            e = LLMEngine(ModelConfig(model=model_dir, dtype="float32", device=device, max_model_len=max_model_len),
                          CacheConfig(block_size=4, num_gpu_blocks_override=blocks),
                          SchedulerConfig(chunked_prefill_size=chunked_prefill_size), keep_finished_blocks=keep)
            made.append(e)
            return e
        fabric = kvtransfer.FakeFabric()
        config = WorkerConfig(kv_backend="fake", log_interval_s=60, kv_lease_s=kv_lease_s)
        p_engine, d_engine = engine(True, 256), engine(False, decode_blocks)
        pool = d_engine.runner.kv_pool.tensor
        receiver = kvtransfer.create_receiver(pool, kvtransfer.KVLayout.of_pool(pool), "fake", fabric=fabric)
        prefill = PrefillLoop(p_engine, config, WorkerMetrics("prefill"), fabric=fabric)
        prefills = {"in-process": prefill}

        def send_destination(job: DecodeJob, descriptor: bytes) -> None:  # the SetDestination RPC
            destination = Destination(list(job.transfer_block_ids), descriptor)
            target = prefills.get(job.prefill_address)
            if target is not None:  # an unknown address is a prefill worker that died
                target.call(lambda: target.set_destination(job.request_id, destination))

        decode = DecodeLoop(d_engine, config, WorkerMetrics("decode"), receiver, send_destination)
        prefill.start()
        decode.start()
        made.append((prefill, decode, receiver))
        return prefill, decode

    yield make
    for item in made:
        if isinstance(item, tuple):
            prefill, decode, receiver = item
            decode.stop()
            prefill.stop()
            prefill.close()
            receiver.close()
        else:
            item.close()


@pytest.fixture(scope="session")
def reference(tiny_dir) -> Iterator[Callable[..., list]]:
    """``reference(prompts, params, **llm_options)`` -> the colocated LLM's RequestOutputs.

    One in-process LLM per option set, float32 on one torch thread, like the workers.
    """
    from engine.llm import LLM

    made: dict[tuple, LLM] = {}
    before = torch.get_num_threads()

    def run(prompts: list[list[int]], params: SamplingParams | list[SamplingParams], **options) -> list:
        key = tuple(sorted(options.items()))
        if key not in made:
            made[key] = LLM(str(tiny_dir), **{"dtype": "float32", "device": "cpu", "block_size": BLOCK_SIZE,
                                              "num_gpu_blocks_override": REFERENCE_BLOCKS, **options})
        torch.set_num_threads(1)
        try:
            return made[key].generate(prompts, params)
        finally:
            torch.set_num_threads(before)

    yield run
    for llm in made.values():
        llm.close()
