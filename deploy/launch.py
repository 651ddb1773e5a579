"""Start and stop Tandem's own processes on this host: workers and the router.

Runs in whatever process launches them: benchmarks, tests, and the Ray process hosts of the
orchestration (deploy/controller.py). A service prints one ready line (``TANDEM_WORKER_READY
{json}`` / ``TANDEM_ROUTER_READY {json}``) once its servers listen; ``ServiceProcess`` waits
for that line (or the process's death) with a timeout, and stops the service with SIGTERM, then
SIGKILL. After a SIGKILL, or a crash, it removes the worker's /dev/shm KV pool, which the dead
process cannot unlink itself.

``die_with_parent`` makes the kernel SIGKILL the child when its parent dies (Linux
PR_SET_PDEATHSIG), so a killed Ray actor never leaves a worker behind; it also puts the child in
its own session, so a Ctrl-C meant for ``tandem serve`` reaches the controller, which stops
the child in order, and not the child directly. ``stderr_tail`` keeps the last lines of the
child's stderr (still echoed to this process's stderr) for error reports.
"""
from __future__ import annotations

import collections
import ctypes
import functools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from protos.limits import ROLES
from tandem_shm.pools import pools_of, remove_pools_of
from worker.process import READY_PREFIX

REPO_ROOT = Path(__file__).resolve().parent.parent
_PR_SET_PDEATHSIG = 1


class WorkerStartError(RuntimeError):
    """The service exited or stayed silent instead of reporting ready."""


def _in_child(die_with_parent: bool, nice: int) -> None:
    """Runs in the child before exec: its own session, killed with its parent; ``nice`` more
    niceness (a lower CPU priority: cores it shares with the other processes go to them first)."""
    if die_with_parent:
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if nice:
        os.nice(nice)


class ServiceProcess:
    """One child process that reports readiness with a ``<prefix>{json}`` line on stdout."""

    def __init__(self, name: str, argv: list[str], ready_prefix: str, *, stderr: IO[bytes] | None = None,
                 env: dict[str, str] | None = None, die_with_parent: bool = False, stderr_tail: int = 0,
                 nice: int = 0) -> None:
        self.name = name
        self.ready_prefix = ready_prefix
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._tail: collections.deque[str] = collections.deque(maxlen=max(stderr_tail, 1))
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, env=env,
                                     stderr=subprocess.PIPE if stderr_tail else stderr,
                                     preexec_fn=functools.partial(_in_child, die_with_parent, nice)
                                     if die_with_parent or nice else None)
        self._stderr_thread = None
        if stderr_tail:
            self._stderr_thread = threading.Thread(target=self._pump_stderr, name=f"{name}-stderr", daemon=True)
            self._stderr_thread.start()
        self._buf = b""
        self.info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self) -> str:
        """The last lines the child wrote to stderr (with ``stderr_tail``)."""
        if self._stderr_thread is not None and self.proc.poll() is not None:
            self._stderr_thread.join(2.0)   # the pipe is at EOF once the child is gone
        return "".join(self._tail)

    def _pump_stderr(self) -> None:
        assert self.proc.stderr is not None   # piped (stderr_tail)
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode(errors="replace")
            self._tail.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def wait_ready(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """The ready line's fields; stops the child and raises WorkerStartError if none comes."""
        started = time.monotonic()
        try:
            while True:
                info = self.poll_ready(0.2)
                if info is not None:
                    return info
                if time.monotonic() - started >= timeout_s:
                    raise WorkerStartError(f"{self.name} did not report ready within {timeout_s:.0f} s; "
                                           f"stdout: {self._buf.decode(errors='replace')!r}")
        except WorkerStartError:
            self.stop()
            raise

    def poll_ready(self, timeout_s: float = 0.0) -> dict[str, Any] | None:
        """The ready line's fields once it came, None while still starting; raises
        WorkerStartError when the child exited first (its stderr says why)."""
        if self.info:
            return self.info
        assert self.proc.stdout is not None   # always piped: the ready line comes on it
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            if select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                chunk = os.read(fd, 4096)
                if chunk:
                    self._buf += chunk
                    for line in self._buf.decode(errors="replace").splitlines():
                        if line.startswith(self.ready_prefix):
                            self.info = json.loads(line[len(self.ready_prefix):])
                            return self.info
                    continue
                break                                   # EOF: the child is exiting
            if self.proc.poll() is not None:
                break
            if time.monotonic() >= deadline:
                return None
        try:
            code = self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            code = None
        self.cleanup()
        tail = self.stderr_tail()
        raise WorkerStartError(f"{self.name} exited before it was ready (exit code {code})"
                               + (f"; last stderr lines:\n{tail}" if tail else "; its stderr says why")
                               + (f"\nstdout: {self._buf.decode(errors='replace')!r}" if self._buf.strip() else ""))

    def returncode(self) -> int | None:
        """None while running; the exit code (negative: killed by that signal) once it ended."""
        code = self.proc.poll()
        if code is not None:
            self.cleanup()
        return code

    def shm_files(self) -> list[Path]:
        return pools_of(self.proc.pid)

    def cleanup(self) -> None:
        """Remove what a dead child could not: its /dev/shm KV pools."""
        if self.proc.poll() is not None:
            remove_pools_of(self.proc.pid)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()
        self.cleanup()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (as a crash would), then remove the pool the dead process left behind."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.cleanup()


class WorkerProcess(ServiceProcess):
    """``python -m {role}_worker FLAGS``; ``grpc``, ``metrics`` and ``pid`` come from its ready line."""

    def __init__(self, role: str, flags: list[str], *, stderr: IO[bytes] | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 120.0, wait: bool = True,
                 die_with_parent: bool = False, stderr_tail: int = 0, nice: int = 0) -> None:
        """Spawn the worker; with ``wait`` (default) return only once it is ready. Start several
        with ``wait=False`` and call ``wait_ready`` on each to load their models in parallel."""
        if role not in ROLES:
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self.role = role
        super().__init__(f"{role} worker", [sys.executable, "-m", f"{role}_worker", *flags], READY_PREFIX,
                         stderr=stderr, env=env, die_with_parent=die_with_parent, stderr_tail=stderr_tail,
                         nice=nice)
        if wait:
            self.wait_ready(start_timeout_s)

    @property
    def grpc(self) -> str:
        return self.info["grpc"]

    @property
    def metrics(self) -> str | None:
        return self.info["metrics"]
