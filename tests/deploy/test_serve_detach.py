"""`tandem serve --detach` on a machine without a Ray cluster: it starts one with `ray start`, and
`tandem down` stops the deployment and that cluster. (Its own module: the module-scoped
deployment of test_serve_e2e.py must not be running, `ray start` takes the default port.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deploy.launch import REPO_ROOT
from tests.deploy.serving import MODEL, SERVE_TIMEOUT_S, all_pids, assert_nothing_left, completions, wait_for

pytestmark = pytest.mark.slow


def test_detach_starts_a_ray_cluster_that_down_stops(tmp_path):
    # `ray start` takes the default port 6379: the local clusters of the tests above must be gone.
    wait_for(lambda: not subprocess.run(["pgrep", "raylet"], capture_output=True).stdout,
             "earlier local Ray clusters exiting", 60)
    cli = [sys.executable, "-m", "deploy.cli"]
    done = subprocess.run([*cli, "serve", "--address", "local", "--detach", "--http-port", "0", "--grpc-port", "0",
                           "--kv-cache-memory", str(256 << 20), "--max-model-len", "2048"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=SERVE_TIMEOUT_S)
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "detached: `tandem status` shows the workers" in done.stdout
        status = json.loads(subprocess.run([*cli, "status", "--json"], capture_output=True, text=True,
                                           cwd=REPO_ROOT, timeout=120, check=True).stdout)
        assert status["started_ray"] and len(status["workers"]) == 2
        assert completions(f"http://{status['router']['http']}", MODEL, ["Hello"], 4)[0]
    finally:
        down = subprocess.run([*cli, "down"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert "stopped the deployment and the Ray cluster" in down.stdout, down.stdout + down.stderr
    again = subprocess.run([*cli, "status"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert again.returncode == 2 and "nothing is serving here" in again.stderr
    assert_nothing_left(all_pids(status))
    wait_for(lambda: not subprocess.run(["pgrep", "raylet"], capture_output=True).stdout, "raylet exiting", 60)
