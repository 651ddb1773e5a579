"""The engine tests' private cache for the C libraries that engine/native.py builds."""
from pathlib import Path

import pytest

from engine.attention import cpu_kernels


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch) -> Path:
    """An empty kernel cache directory, and no attention library already loaded in this process."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    cpu_kernels.load.cache_clear()
    yield tmp_path / "cache" / "kernels"
    cpu_kernels.load.cache_clear()  # the next test loads from the real cache again
