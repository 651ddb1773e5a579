"""Building and caching the C libraries of engine/csrc/ (engine/native.py), with the paged
attention kernels (engine/attention/cpu_kernels.py) as the library built."""
from __future__ import annotations

import subprocess
import threading

import pytest

from engine import native
from engine.attention import cpu_kernels


@pytest.fixture
def compiles(monkeypatch) -> list[list[str]]:
    """Records every compiler run that produces a library (not the --version probes)."""
    calls: list[list[str]] = []
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        if "-o" in cmd:
            calls.append(list(cmd))
        return real_run(cmd, *args, **kwargs)
    monkeypatch.setattr(native.subprocess, "run", run)
    return calls


def test_library_lands_in_the_cache_directory(kernel_cache, compiles):
    path = native.build(cpu_kernels.SOURCE)
    assert path.parent == kernel_cache
    assert path.name.startswith("paged_attention-") and path.suffix == ".so"
    assert len(compiles) == 1
    assert cpu_kernels.open_library(path).tandem_abi_version() == cpu_kernels.ABI_VERSION
    assert sorted(p.name for p in kernel_cache.iterdir()) == [path.name]  # no temp files left


def test_second_build_reuses_the_cached_library(kernel_cache, compiles):
    first = native.build(cpu_kernels.SOURCE)
    mtime = first.stat().st_mtime_ns
    cpu_kernels.load()
    cpu_kernels.load.cache_clear()
    cpu_kernels.load()  # as a second worker process would
    assert native.build(cpu_kernels.SOURCE) == first
    assert len(compiles) == 1
    assert first.stat().st_mtime_ns == mtime


def test_changed_source_builds_a_new_library(kernel_cache, compiles, tmp_path):
    first = native.build(cpu_kernels.SOURCE)
    changed = tmp_path / "paged_attention.c"
    changed.write_text(cpu_kernels.SOURCE.read_text() + "\n/* changed */\n")
    second = native.build(changed)
    assert second != first and second.exists() and first.exists()
    assert len(compiles) == 2


def test_concurrent_builds_leave_one_whole_library(kernel_cache):
    paths, errors = [], []

    def build():
        try:
            paths.append(native.build(cpu_kernels.SOURCE))
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


def test_unwritable_cache_gives_a_clear_error(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocker))
    with pytest.raises(native.KernelBuildError, match="set TANDEM_CACHE_DIR to a writable"):
        native.build(cpu_kernels.SOURCE)
