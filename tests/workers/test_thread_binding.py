"""A CPU worker binds its engine thread's torch threads one to a CPU (WorkerConfig.bind_threads),
and leaves every other thread, and every thread with --no-bind-threads, to the scheduler."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs at least 2 CPUs")


def single_cpu_threads(pid: int) -> dict[str, int]:
    """{thread id: its CPU} of the threads of ``pid`` allowed on exactly one CPU."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:   # the thread ended meanwhile
            continue
        allowed = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                       if line.startswith("Cpus_allowed_list"))
        if allowed.isdigit():
            found[tid] = int(allowed)
    return found


def test_a_cpu_workers_torch_threads_are_bound_one_to_a_cpu(spawn, tiny_dir):
    cpus = sorted(os.sched_getaffinity(0))   # one torch thread for each CPU the worker may use
    worker = spawn("decode", tiny_dir, "--num-threads", str(len(cpus)))
    assert f"engine thread's {len(cpus)} torch threads bound to CPUs {cpus}" in worker.stderr()
    bound = single_cpu_threads(worker.proc.pid)
    assert sorted(bound.values()) == cpus, bound   # the engine thread and torch's other threads
    assert str(worker.proc.pid) not in bound        # the main thread (gRPC, asyncio) is not bound
    assert worker.stats().num_running == 0           # and it serves


def test_no_bind_threads_leaves_them_to_the_scheduler(spawn, tiny_dir):
    worker = spawn("decode", tiny_dir, "--num-threads", "2", "--no-bind-threads")
    assert "bound to CPUs" not in worker.stderr()
    assert single_cpu_threads(worker.proc.pid) == {}


BIND_IN_A_CHILD = """
import os, sys, torch
from engine.models import cpu_ops
os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
torch.set_num_threads(int(sys.argv[2]))
print(cpu_ops.load().bind_threads(int(sys.argv[2])))
"""


def test_threads_are_bound_only_when_there_is_one_for_each_cpu():
    from engine.models.cpu_ops import cpus_to_bind
    assert cpus_to_bind(2, [0, 1]) == [0, 1]
    assert cpus_to_bind(4, [2, 3, 5, 7]) == [2, 3, 5, 7]
    # Fewer threads than CPUs: two workers of 2 threads on 4 CPUs would both take CPUs 0 and 1.
    assert cpus_to_bind(2, [0, 1, 2, 3]) == []
    assert cpus_to_bind(3, [0, 1]) == [] and cpus_to_bind(1, [0]) == []


@pytest.mark.parametrize("cpus, threads, bound", [("0,1", 2, "[0, 1]"), ("0,1", 1, "[]"), ("0,1", 3, "[]")])
def test_a_team_is_bound_in_a_child_process(cpus, threads, bound):
    # In a child: binding is for the life of a thread, and pytest's threads must keep every CPU.
    out = subprocess.run([sys.executable, "-c", BIND_IN_A_CHILD, cpus, str(threads)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == bound
