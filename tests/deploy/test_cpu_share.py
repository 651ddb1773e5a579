"""How `tandem serve` shares a CPU node's cores among its worker ranks: threads per role,
passive OpenMP waits when the ranks' threads outnumber the cores, and the niceness a started
process gets."""
from __future__ import annotations

import os
import sys

from deploy.controller import ServeSpec, worker_argvs, worker_env
from deploy.launch import ServiceProcess

NODE = {"ip": "10.1.2.3", "node_id": "n1", "cpus": 2}
RANKS = {"prefill": 1, "decode": 1}


def _spec(**kw) -> ServeSpec:
    return ServeSpec(model="m", replicas={"prefill": 1, "decode": 1}, tp={"prefill": 1, "decode": 1},
                     worker_flags=[], router_flags=[], **kw)


def _threads(spec: ServeSpec, role: str) -> int:
    argv = worker_argvs(spec, role, 1, NODE, 2, None)[0]
    return int(argv[argv.index("--num-threads") + 1])


def test_by_default_each_rank_gets_an_equal_share_of_the_cores_and_openmp_is_left_alone(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    spec = _spec()
    assert (_threads(spec, "prefill"), _threads(spec, "decode")) == (1, 1)
    assert "OMP_WAIT_POLICY" not in worker_env(spec, RANKS, NODE["cpus"])


def test_role_threads_that_oversubscribe_the_cores_get_passive_openmp_waits(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    spec = _spec(threads={"prefill": 2, "decode": 0})
    assert (_threads(spec, "prefill"), _threads(spec, "decode")) == (2, 1)
    assert worker_env(spec, RANKS, NODE["cpus"])["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")              # the operator's choice stands
    assert "OMP_WAIT_POLICY" not in worker_env(spec, RANKS, NODE["cpus"])
    gpu = _spec(threads={"prefill": 2}, use_gpu=True)
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert "OMP_WAIT_POLICY" not in worker_env(gpu, RANKS, NODE["cpus"])
    assert "--num-threads" not in worker_argvs(gpu, "prefill", 1, NODE, 2, None)[0]


def test_a_started_process_gets_the_niceness_asked_for_on_top_of_ours():
    code = "import os, time; print('READY {\"nice\": %d}' % os.nice(0), flush=True); time.sleep(30)"
    proc = ServiceProcess("nice", [sys.executable, "-c", code], "READY ", nice=5)
    try:
        assert proc.poll_ready(30) == {"nice": os.nice(0) + 5}
    finally:
        proc.stop(5)
