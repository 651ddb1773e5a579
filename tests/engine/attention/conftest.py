"""Markers for the attention tests (``gpu`` needs CUDA, ``slow`` takes more than a few seconds);
their private kernel cache (``kernel_cache``) is tests/engine/conftest.py's."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")

