from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.kvtransfer.conftest import REPO_ROOT


@pytest.mark.slow
def test_bench_prints_one_json_object_last():
    out = subprocess.run(
        [sys.executable, "-m", "kvtransfer.bench", "--json", "--tokens", "32", "64", "--iters", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    for key in ("memcpy_gbps", "shm_gbps", "tcp_gbps", "zmq_raw_gbps", "nixl_gbps"):
        assert set(result[key]) == {"32", "64"} and all(v > 0 for v in result[key].values())
    assert set(result["request_latency_ms"]) == {"fake", "shm", "tcp", "nixl"}   # nixl: setup.sh --test installs it
    assert result["request_bytes"] == {"32": 30 * 2 * 2 * 6144, "64": 30 * 2 * 4 * 6144}
