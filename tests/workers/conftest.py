"""Fixtures for the worker-process tests: the tiny checkpoint, worker processes, references.

The tiny random-weight Llama of tests/engine/conftest.py (SmolLM2 tokenizer beside it) serves
every test but the SmolLM2 one. Workers run as real processes on one torch thread each (the
machine has 2 cores shared by two workers and pytest) and are always stopped at teardown; a
worker's stderr is printed at teardown, which pytest shows only for a failed test.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.config import SamplingParams

# Session fixtures that build the tiny HF checkpoint (imported so pytest registers them here).
from tests.engine.conftest import random_prompt, smollm2_gguf, smollm2_tokenizer, tiny_model_dir, tokenizer_files  # noqa: F401
from tests.workers.harness import Worker

BLOCK_SIZE = 16
POOL_BLOCKS = 256
REFERENCE_BLOCKS = 512
# Worker logprobs against the colocated LLM's, float32 on both sides: at most 3e-6 apart measured
# (batches differ between the two, so the reductions do too).
LOGPROB_ABS_TOL = 2e-5


@pytest.fixture(scope="session")
def tiny_dir(tiny_model_dir) -> Path:  # noqa: F811 - the imported fixture, by name
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


def pool_flags(num_blocks: int = POOL_BLOCKS, block_size: int = BLOCK_SIZE) -> list[str]:
    return ["--num-gpu-blocks-override", str(num_blocks), "--block-size", str(block_size)]


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


def prompts_for(lengths: list[int], seed: int) -> list[list[int]]:
    return [random_prompt(seed=seed + i, num_tokens=n) for i, n in enumerate(lengths)]


def check_greedy_matches_colocated(prefill, decode, reference, lengths: list[int], max_tokens: list[int],
                                   seed: int, tag: str) -> list:
    """Concurrent greedy requests through the P/D pair: every one gives the colocated LLM's tokens
    and ends with finish_reason "length"; returns the results (both workers idle again)."""
    from tests.workers.harness import generate, greedy, run_concurrently, wait_idle

    prompts = prompts_for(lengths, seed=seed)
    expected = reference(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens])
    results = run_concurrently([
        (lambda i=i: generate(prefill, decode, f"{tag}-{i}", prompts[i], greedy(max_tokens[i])))
        for i in range(len(prompts))])
    assert len(results) == len(expected) == len(prompts)
    for i, (result, ref) in enumerate(zip(results, expected)):
        assert result.error is None and result.submit_error is None, (i, result.error, result.submit_error)
        assert result.token_ids == ref.token_ids, f"request {i} (prompt {lengths[i]} tokens)"
        assert result.final.finish_reason == "length"
    wait_idle(prefill, decode)
    return results


def check_logprobs_match(result, ref, num_top: int) -> None:
    """A worker pair's TokenLogprobs equal the colocated LLM's entries: one per token, the
    sampled token's logprob, and the top ``num_top`` token ids (in order) with their logprobs."""
    assert len(result.logprobs) == len(ref.logprobs) == len(ref.token_ids)
    for token, entry, got in zip(ref.token_ids, ref.logprobs, result.logprobs):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
        assert got.token_id == token
        assert got.logprob == pytest.approx(entry[token], abs=LOGPROB_ABS_TOL)
        assert list(got.top_token_ids) == [t for t, _ in top]
        assert list(got.top_logprobs) == pytest.approx([lp for _, lp in top], abs=LOGPROB_ABS_TOL)
