"""The machine `ray up` runs on, for tests that launch clusters with the shipped YAMLs: a HOME
holding Ray's token (the YAMLs copy ``~/.ray/auth_token`` to every node), and the venv's `ray`
CLI run from the repository root (file_mounts' ``.`` is the checkout)."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from deploy.launch import REPO_ROOT

RAY = Path(sys.executable).parent / "ray"


def launcher_home(root: Path) -> Path:
    """A new HOME under ``root`` with a private Ray token in ``.ray/auth_token``."""
    home = root / "launcher-home"
    (home / ".ray").mkdir(parents=True)
    token = home / ".ray" / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    return home


def ray_cli(*args: str, home: Path, timeout_s: float) -> tuple[int, str]:
    """``ray ARGS`` with HOME=``home`` and no cluster secret in its environment; (exit code,
    stdout and stderr together), -1 when it ran past ``timeout_s``."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", HOME=str(home))
    env.pop("TANDEM_CLUSTER_SECRET", None)
    try:
        done = subprocess.run([str(RAY), *args], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.output.decode(errors="replace") if isinstance(e.output, bytes) else (e.output or "")
        return -1, f"{out}\n[ray {args[0]} timed out after {timeout_s} s]"
    return done.returncode, done.stdout
