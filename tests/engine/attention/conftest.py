"""Markers for the attention tests (``gpu`` needs CUDA, ``slow`` takes more than a few seconds) and
a private cache for the CPU backend's C kernels."""
from pathlib import Path

import pytest

from engine.attention import cpu_kernels


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch) -> Path:
    """An empty kernel cache directory, and no library already loaded in this process."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    cpu_kernels.load.cache_clear()
    yield tmp_path / "cache" / "kernels"
    cpu_kernels.load.cache_clear()  # the next test loads from the real cache again
