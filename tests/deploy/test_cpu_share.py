"""How `tandem serve` shares a CPU node's cores among its worker ranks: threads per role,
short OpenMP spins in every engine process, and the niceness a started process gets."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deploy.controller import ServeSpec, worker_argvs
from deploy.launch import ServiceProcess

NODE = {"ip": "10.1.2.3", "node_id": "n1", "cpus": 2}
RANKS = {"prefill": 1, "decode": 1}


def _spec(**kw) -> ServeSpec:
    return ServeSpec(model="m", replicas={"prefill": 1, "decode": 1}, tp={"prefill": 1, "decode": 1},
                     worker_flags=[], router_flags=[], **kw)


def _threads(spec: ServeSpec, role: str) -> int:
    argv = worker_argvs(spec, role, 1, NODE, RANKS, None)[0]
    return int(argv[argv.index("--num-threads") + 1])


def test_by_default_decode_gets_a_share_of_the_cores_and_prefill_all_of_them():
    spec = _spec()
    assert (_threads(spec, "prefill"), _threads(spec, "decode")) == (2, 1)
    eight = {"prefill": 3, "decode": 1}                              # 3P1D on 8 cores: 2 each
    big = {**NODE, "cpus": 8}
    assert [int(worker_argvs(spec, role, 1, big, eight, None)[0][-1]) for role in ("prefill", "decode")] == [2, 2]


def test_with_local_prefill_decode_ranks_share_all_the_cores():
    spec = _spec(local_prefill=True)
    assert (_threads(spec, "prefill"), _threads(spec, "decode")) == (2, 2)
    big = {**NODE, "cpus": 8}
    two_decode = {"prefill": 1, "decode": 2}                         # 1P2D on 8 cores: decode 4 each
    assert int(worker_argvs(spec, "decode", 1, big, two_decode, None)[0][-1]) == 4
    assert _threads(_spec(local_prefill=True, threads={"decode": 1}), "decode") == 1


def test_the_operators_thread_counts_stand_and_gpu_ranks_get_none():
    spec = _spec(threads={"prefill": 1, "decode": 1})
    assert (_threads(spec, "prefill"), _threads(spec, "decode")) == (1, 1)
    gpu = _spec(use_gpu=True)
    assert "--num-threads" not in worker_argvs(gpu, "prefill", 1, NODE, RANKS, None)[0]


@pytest.mark.parametrize("env, expected", [({}, "20000 None"), ({"OMP_WAIT_POLICY": "PASSIVE"}, "None PASSIVE"),
                                           ({"GOMP_SPINCOUNT": "7"}, "7 None")])
def test_an_engine_process_spins_briefly_unless_the_operator_chose(env, expected):
    """What libgomp reads when torch loads: importing engine first (every worker does) sets a
    short spin, and a wait policy or spin count from the environment (the operator's) wins."""
    code = ("import engine, os, torch; "
            "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split("\n")[-2] == expected


def test_a_started_process_gets_the_niceness_asked_for_on_top_of_ours():
    code = "import os, time; print('READY {\"nice\": %d}' % os.nice(0), flush=True); time.sleep(30)"
    proc = ServiceProcess("nice", [sys.executable, "-c", code], "READY ", nice=5)
    try:
        assert proc.poll_ready(30) == {"nice": os.nice(0) + 5}
    finally:
        proc.stop(5)
