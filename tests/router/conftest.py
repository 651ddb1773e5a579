"""Fixtures for the router tests: an asyncio loop on a thread, SmolLM2's tokenizer, and one router
over one fake prefill and one fake decode worker (tests/router/clusters.py builds them).
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.tokenizer import Tokenizer
from tests.router.clusters import MODEL, FakeCluster, LoopThread, fake_cluster_running


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model(MODEL)


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture(scope="module")
def fake_cluster(loop_thread, tokenizer) -> Iterator[FakeCluster]:
    """One router over one fake prefill + one fake decode worker, shared by a module."""
    with fake_cluster_running(loop_thread, tokenizer) as cluster:
        yield cluster
