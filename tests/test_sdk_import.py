"""Importing the client SDK (tandem_client/) changes nothing in the user's process.

It used to live in the router package, whose import set ``GRPC_EXPERIMENTS`` (protos/grpc_io.py)
and so chose grpc's I/O path for the user's whole process. The check runs in a fresh interpreter
with no ``GRPC_EXPERIMENTS``, as a user's program starts (this test session has set it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from protos.grpc_io import EXPERIMENTS

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, logging, os, sys, threading
env = dict(os.environ)
threads = threading.active_count()
handlers = list(logging.getLogger().handlers)
import {module}
import grpc
print(json.dumps({{
    "env_changes": sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)),
    "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS"),
    "new_threads": threading.active_count() - threads,
    "root_handlers_changed": logging.getLogger().handlers != handlers,
    "tandem_modules": sorted({{m.split(".")[0] for m in sys.modules}} & {{"router", "engine", "deploy", "kvtransfer",
                                                                       "prefill_worker", "decode_worker", "torch"}}),
}}))
"""


def import_effects(module: str, cwd: Path = ROOT) -> dict:
    """What importing ``module`` did to a fresh interpreter (with GRPC_EXPERIMENTS unset)."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_importing_the_sdk_changes_nothing_in_the_users_process():
    assert import_effects("tandem_client") == {
        "env_changes": [], "grpc_experiments": None, "new_threads": 0, "root_handlers_changed": False,
        "tandem_modules": []}


def test_the_router_still_runs_on_the_polling_path():
    """The choice moved to the router's entry point: ``python -m router`` makes it before grpc loads."""
    code = ("import os, runpy, sys; sys.argv = ['router', '--help']\n"
            "try:\n    runpy.run_module('router', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "import grpc\nprint(os.environ.get('GRPC_EXPERIMENTS'))")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == EXPERIMENTS
