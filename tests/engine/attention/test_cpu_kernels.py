"""Building, caching and loading the C kernels of the CPU attention backend."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.attention import cpu_kernels

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def compiles(monkeypatch) -> list[list[str]]:
    """Records every compiler run that produces a library (not the --version probes)."""
    calls: list[list[str]] = []
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        if "-o" in cmd:
            calls.append(list(cmd))
        return real_run(cmd, *args, **kwargs)
    monkeypatch.setattr(cpu_kernels.subprocess, "run", run)
    return calls


def _fake_compiler(tmp_path: Path, stderr: str) -> str:
    """A CC that answers --version but fails to compile, printing ``stderr``."""
    cc = tmp_path / "fakecc"
    cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "fakecc 1.0"; exit 0; }}\n'
                  f'echo "{stderr}" >&2\nexit 1\n')
    cc.chmod(0o755)
    return str(cc)


def test_library_lands_in_the_cache_directory(kernel_cache, compiles):
    path = cpu_kernels.build()
    assert path.parent == kernel_cache
    assert path.name.startswith("paged_attention-") and path.suffix == ".so"
    assert len(compiles) == 1
    assert cpu_kernels.open_library(path).tandem_abi_version() == cpu_kernels.ABI_VERSION
    assert sorted(p.name for p in kernel_cache.iterdir()) == [path.name]  # no temp files left


def test_second_build_reuses_the_cached_library(kernel_cache, compiles):
    first = cpu_kernels.build()
    mtime = first.stat().st_mtime_ns
    cpu_kernels.load()
    cpu_kernels.load.cache_clear()
    cpu_kernels.load()  # as a second worker process would
    assert cpu_kernels.build() == first
    assert len(compiles) == 1
    assert first.stat().st_mtime_ns == mtime


def test_changed_source_builds_a_new_library(kernel_cache, compiles, tmp_path, monkeypatch):
    first = cpu_kernels.build()
    changed = tmp_path / "paged_attention.c"
    changed.write_text(cpu_kernels.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", changed)
    second = cpu_kernels.build()
    assert second != first and second.exists() and first.exists()
    assert len(compiles) == 2


def test_concurrent_builds_leave_one_whole_library(kernel_cache):
    paths, errors = [], []

    def build():
        try:
            paths.append(cpu_kernels.build())
        except Exception as e:  # reported below
            errors.append(e)
    workers = [threading.Thread(target=build) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not errors and len(set(paths)) == 1
    assert [p.name for p in kernel_cache.iterdir()] == [paths[0].name]
    assert cpu_kernels.open_library(paths[0]).tandem_abi_version() == cpu_kernels.ABI_VERSION


def test_compiler_that_cannot_run_gives_a_clear_error(kernel_cache, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.raises(cpu_kernels.KernelBuildError,
                       match=r"CC='/bin/false' failed .*use --attention-backend torch"):
        cpu_kernels.load()


def test_missing_compiler_gives_a_clear_error(kernel_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(cpu_kernels.KernelBuildError, match="cannot run the C compiler"):
        cpu_kernels.load()


def test_compile_error_is_reported_and_leaves_nothing_behind(kernel_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, "paged_attention.c:1: error: boom"))
    with pytest.raises(cpu_kernels.KernelBuildError, match="error: boom"):
        cpu_kernels.load()
    assert list(kernel_cache.iterdir()) == []


def test_unwritable_cache_gives_a_clear_error(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocker))
    with pytest.raises(cpu_kernels.KernelBuildError, match="set TANDEM_CACHE_DIR to a writable"):
        cpu_kernels.build()


def test_missing_source_gives_a_clear_error(kernel_cache, monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "SOURCE", tmp_path / "paged_attention.c")
    with pytest.raises(cpu_kernels.KernelBuildError, match="kernel source .* is missing"):
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
