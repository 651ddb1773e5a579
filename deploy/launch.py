"""Start and stop worker processes on this host (`python -m prefill_worker|decode_worker`).

Runs in whatever process launches workers: benchmarks, tests, and (later) the orchestration.
A worker prints ``TANDEM_WORKER_READY {json}`` once its servers listen; ``WorkerProcess`` waits
for that line (or the process's death) with a timeout, and stops the worker with SIGTERM, then
SIGKILL. After a SIGKILL it removes the worker's /dev/shm KV pool, which the dead process
cannot unlink itself.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from engine.serving.process import READY_PREFIX

REPO_ROOT = Path(__file__).resolve().parent.parent
SHM_DIR = Path("/dev/shm")


class WorkerStartError(RuntimeError):
    """The worker exited or stayed silent instead of reporting ready."""


class WorkerProcess:
    """One worker child process; ``grpc``, ``metrics`` and ``pid`` come from its READY line."""

    def __init__(self, role: str, flags: list[str], *, stderr: IO[bytes] | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 120.0, wait: bool = True) -> None:
        """Spawn the worker; with ``wait`` (default) return only once it is ready. Start several
        with ``wait=False`` and call ``wait_ready`` on each to load their models in parallel."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self.role = role
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", f"{role}_worker", *flags], cwd=REPO_ROOT,
                                     stdout=subprocess.PIPE, stderr=stderr, env=env)
        self.info: dict[str, Any] = {}
        if wait:
            self.wait_ready(start_timeout_s)

    @property
    def grpc(self) -> str:
        return self.info["grpc"]

    @property
    def metrics(self) -> str | None:
        return self.info["metrics"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """The READY line's fields; stops the worker and raises WorkerStartError if none comes."""
        try:
            self.info = self._read_ready(timeout_s)
        except WorkerStartError:
            self.stop()
            raise
        return self.info

    def _read_ready(self, timeout_s: float) -> dict[str, Any]:
        fd = self.proc.stdout.fileno()
        buf, started = b"", time.monotonic()
        while time.monotonic() - started < timeout_s:
            if select.select([fd], [], [], 0.2)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                buf += chunk
                for line in buf.decode(errors="replace").splitlines():
                    if line.startswith(READY_PREFIX):
                        return json.loads(line[len(READY_PREFIX):])
            elif self.proc.poll() is not None:
                break
        try:
            code = self.proc.wait(1.0)   # stdout closed: the process is exiting
        except subprocess.TimeoutExpired:
            code = None
        raise WorkerStartError(f"{self.role} worker did not report ready after {time.monotonic() - started:.1f} s "
                               f"(exit code {code}; its stderr says why); stdout: {buf.decode(errors='replace')!r}")

    def shm_files(self) -> list[Path]:
        return sorted(SHM_DIR.glob(f"tandem-kv-{self.proc.pid}-*"))

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
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (as a crash would), then remove the pool the dead process left behind."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        for path in self.shm_files():
            path.unlink(missing_ok=True)
