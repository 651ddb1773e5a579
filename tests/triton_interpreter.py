"""Triton kernels checked on CPU: named cases run in a child process under TRITON_INTERPRET=1
(the interpreter is chosen at import, so the pytest process itself never sets it).

A checks module keeps ``INTERPRETER_CASES`` (name -> a callable that raises on a wrong result) and
ends with ``if __name__ == "__main__": report(INTERPRETER_CASES)``; its test file calls
``interpret("tests....module")`` once and asserts each case's entry is None."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def report(cases: dict[str, Callable[[], object]]) -> None:
    """Child side: run every case, print name -> None or the failure's traceback as JSON."""
    results: dict[str, str | None] = {}
    for name, case in cases.items():
        try:
            case()
            results[name] = None
        except Exception:  # every failure is reported by name, the rest still run
            results[name] = traceback.format_exc()
    json.dump(results, sys.stdout)


def interpret(module: str, timeout_s: float = 300) -> dict[str, str | None]:
    """Parent side: ``python -m module`` under the interpreter; its report."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)
