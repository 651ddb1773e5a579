"""Loading the C kernels of the CPU attention backend: what a failed build tells the user, and the
prebuild entry point (how engine/native.py builds and caches them: tests/engine/test_native.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.attention import cpu_kernels
from engine.native import KernelBuildError

REPO_ROOT = Path(__file__).resolve().parents[3]


def _fake_compiler(tmp_path: Path, stderr: str) -> str:
    """A CC that answers --version but fails to compile, printing ``stderr``."""
    cc = tmp_path / "fakecc"
    cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "fakecc 1.0"; exit 0; }}\n'
                  f'echo "{stderr}" >&2\nexit 1\n')
    cc.chmod(0o755)
    return str(cc)


def test_compiler_that_cannot_run_gives_a_clear_error(kernel_cache, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.raises(KernelBuildError,
                       match=r"CC='/bin/false' failed .*use --attention-backend torch"):
        cpu_kernels.load()


def test_missing_compiler_gives_a_clear_error(kernel_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(KernelBuildError, match="cannot run the C compiler"):
        cpu_kernels.load()


def test_compile_error_is_reported_and_leaves_nothing_behind(kernel_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, "paged_attention.c:1: error: boom"))
    with pytest.raises(KernelBuildError, match="error: boom"):
        cpu_kernels.load()
    assert list(kernel_cache.iterdir()) == []


def test_missing_source_gives_a_clear_error(kernel_cache, monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "SOURCE", tmp_path / "paged_attention.c")
    with pytest.raises(KernelBuildError, match="kernel source .* is missing"):
        cpu_kernels.load()


def _build_cli(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.attention.cpu_backend", "--build"],
                          cwd=REPO_ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)


def test_build_entry_point_prebuilds(kernel_cache):
    proc = _build_cli({"TANDEM_CACHE_DIR": str(kernel_cache.parent)})
    assert proc.returncode == 0, proc.stderr
    assert "CPU attention kernels ready" in proc.stdout
    assert len(list(kernel_cache.glob("paged_attention-*.so"))) == 1


def test_build_entry_point_fails_cleanly_without_a_compiler(kernel_cache):
    proc = _build_cli({"TANDEM_CACHE_DIR": str(kernel_cache.parent), "CC": "/bin/false"})
    assert proc.returncode == 1
    assert "CPU attention kernels not built" in proc.stderr
    assert "Traceback" not in proc.stderr
