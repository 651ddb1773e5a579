"""How `tandem serve` shares a CPU node's cores among its worker ranks: threads per role,
short OpenMP spins when the ranks' threads outnumber the cores, and the niceness a started
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
    argv = worker_argvs(spec, role, 1, NODE, RANKS, None)[0]
    return int(argv[argv.index("--num-threads") + 1])


def _no_omp_env(monkeypatch) -> None:
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)


def test_by_default_decode_gets_a_share_of_the_cores_and_prefill_all_of_them_with_short_spins(monkeypatch):
    _no_omp_env(monkeypatch)
    spec = _spec()
    assert (_threads(spec, "prefill"), _threads(spec, "decode")) == (2, 1)
    assert worker_env(spec, RANKS, NODE["cpus"])["GOMP_SPINCOUNT"] == "2000"
    eight = {"prefill": 3, "decode": 1}                              # 3P1D on 8 cores: 2 each
    big = {**NODE, "cpus": 8}
    assert [int(worker_argvs(spec, role, 1, big, eight, None)[0][-1]) for role in ("prefill", "decode")] == [2, 2]


def test_threads_that_fit_the_cores_leave_openmp_alone_and_the_operators_choice_stands(monkeypatch):
    _no_omp_env(monkeypatch)
    spec = _spec(threads={"prefill": 1, "decode": 1})
    assert (_threads(spec, "prefill"), _threads(spec, "decode")) == (1, 1)
    assert "GOMP_SPINCOUNT" not in worker_env(spec, RANKS, NODE["cpus"])
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "GOMP_SPINCOUNT" not in worker_env(_spec(), RANKS, NODE["cpus"])
    _no_omp_env(monkeypatch)
    gpu = _spec(use_gpu=True)
    assert "GOMP_SPINCOUNT" not in worker_env(gpu, RANKS, NODE["cpus"])
    assert "--num-threads" not in worker_argvs(gpu, "prefill", 1, NODE, RANKS, None)[0]


def test_a_started_process_gets_the_niceness_asked_for_on_top_of_ours():
    code = "import os, time; print('READY {\"nice\": %d}' % os.nice(0), flush=True); time.sleep(30)"
    proc = ServiceProcess("nice", [sys.executable, "-c", code], "READY ", nice=5)
    try:
        assert proc.poll_ready(30) == {"nice": os.nice(0) + 5}
    finally:
        proc.stop(5)
