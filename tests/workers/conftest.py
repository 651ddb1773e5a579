"""Fixtures for the tests of both roles together: one prefill/decode pair of worker processes
shared by this folder's modules (``pd_pair``).

The fixtures every worker folder uses (``tiny_dir``, ``spawn``, ``spawn_module``, ``reference``
and the in-process P/D twin ``pd_twin``) are in tests/conftest.py, so tests/prefill_worker/ and
tests/decode_worker/ see them too.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.workers.harness import Worker, pool_flags, spawner, start_pair, wait_idle


@pytest.fixture(scope="package")
def shared_pair(tmp_path_factory, tiny_dir) -> Iterator[tuple[Worker, Worker]]:
    """A prefill and a decode worker process on the tiny Llama (256-block pools, the shm backend,
    a log line a second), started once for the modules of this folder that need no flags of
    their own (a pair takes ~8 s to start on 2 cores) and stopped when the folder is done, so no
    other folder's check for leftover worker processes sees them. Take it through ``pd_pair``."""
    for spawn in spawner(tmp_path_factory.mktemp("workers-shared")):
        yield start_pair(spawn, tiny_dir, *pool_flags(), "--kv-backend", "shm", "--log-interval-s", "1",
                         names=("prefill-shared", "decode-shared"))


@pytest.fixture(scope="module")
def pd_pair(shared_pair) -> Iterator[tuple[Worker, Worker]]:
    """The session's shared prefill/decode pair, for one module; both must be idle when it ends,
    so the next module starts from nothing in flight."""
    yield shared_pair
    wait_idle(*shared_pair)
