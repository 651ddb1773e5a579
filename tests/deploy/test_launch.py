"""deploy.launch: a worker that cannot start is reported with its exit code, not waited on."""
from __future__ import annotations

import time

import pytest

from deploy.launch import WorkerProcess, WorkerStartError


def test_a_worker_that_exits_at_startup_is_reported_at_once(tmp_path):
    log = open(tmp_path / "stderr", "wb")
    started = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"exit code 2"):
        WorkerProcess("decode", ["--model", str(tmp_path / "missing")], stderr=log, start_timeout_s=120)
    log.close()
    assert time.monotonic() - started < 60
    assert "not found" in (tmp_path / "stderr").read_text()


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="prefill or decode"):
        WorkerProcess("router", [])
