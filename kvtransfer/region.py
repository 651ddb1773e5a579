"""Shared-memory KV pools: create, map and remove (receiver and same-host sender processes).

The engine's CPU pool is a file in /dev/shm mapped with ``torch.from_file(shared=True)``; a
same-host sender maps the same file to write blocks one-sidedly. These helpers make such pools
for tests and benchmarks and map a receiver's pool from its descriptor.
"""
from __future__ import annotations

import os
import uuid

import torch

from .layout import KVLayout

SHM_DIR = "/dev/shm"


def create_shm_pool(layout: KVLayout, num_blocks: int, directory: str = SHM_DIR,
                    name: str | None = None) -> tuple[torch.Tensor, str]:
    """Create a zero-filled pool backed by a new file; return ``(tensor, path)``.

    The caller owns the file: call :func:`remove_shm_pool` when done.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    path = os.path.join(directory, name or f"tandem-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, layout.pool_nbytes(num_blocks))
    finally:
        os.close(fd)
    return map_shm_pool(layout, num_blocks, path), path


def map_shm_pool(layout: KVLayout, num_blocks: int, path: str) -> torch.Tensor:
    """Map an existing pool file; refuses a file whose size does not match the layout."""
    expected = layout.pool_nbytes(num_blocks)
    actual = os.stat(path).st_size
    if actual != expected:
        # from_file would silently grow or under-map the file; never write past a real pool.
        raise ValueError(f"shm pool {path} is {actual} bytes, layout needs {expected}")
    flat = torch.from_file(path, shared=True, size=layout.pool_numel(num_blocks),
                           dtype=layout.torch_dtype)
    return flat.view(layout.pool_shape(num_blocks))


def remove_shm_pool(path: str) -> None:
    """Unlink a pool file; mappings stay valid until their tensors are freed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
