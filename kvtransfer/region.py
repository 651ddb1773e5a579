"""Shared-memory KV pools: create, map and remove (receiver and same-host sender processes).

The engine's CPU pool is a file in /dev/shm mapped with ``torch.from_file(shared=True)``; a
same-host sender maps the same file to write blocks one-sidedly. These helpers make such pools
for tests and benchmarks and map a receiver's pool from its descriptor.

A descriptor's ``shm_path`` comes from another process, so it is never opened as given: only a
regular file directly in the pool directory, named by ``POOL_NAME``, owned by this user and
private (0600) is mapped (``check_pool_path``). The directory, the names and how a pool file is
made (all its memory at creation, so a full /dev/shm is an error then, never a SIGBUS at a later
write) are tandem_shm/pools.py's, shared with engine/kv_cache.py.
"""
from __future__ import annotations

import os
import stat

import torch

from tandem_shm.pools import POOL_NAME, POOL_PREFIX, SHM_DIR, create_pool_file

from .layout import KVLayout


def check_pool_path(path: str, directory: str = SHM_DIR) -> str:
    """``path`` if it is a Tandem pool: directly under ``directory``, named by ``POOL_NAME``, a
    regular file (not a link) of this user with no group/other access. Else ValueError."""
    name = os.path.basename(path)
    if (os.path.dirname(os.path.normpath(path)) != os.path.normpath(directory)
            or not POOL_NAME.fullmatch(name)):
        raise ValueError(f"refusing to open {path!r}: not a Tandem KV pool (a file {directory}/"
                         f"{POOL_PREFIX}<pid>-<12 hex digits>)")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ValueError(f"KV pool {path} does not exist on this host") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ValueError(f"refusing to open {path!r}: a KV pool must be a regular file of this user "
                         f"with mode 0600 (it is {stat.filemode(st.st_mode)}, uid {st.st_uid})")
    return path


def is_pool_path(path: str | None, directory: str = SHM_DIR) -> bool:
    try:
        return path is not None and bool(check_pool_path(path, directory))
    except ValueError:
        return False


def create_shm_pool(layout: KVLayout, num_blocks: int, directory: str = SHM_DIR,
                    name: str | None = None) -> tuple[torch.Tensor, str]:
    """Create a zero-filled pool backed by a new file; return ``(tensor, path)``.

    The caller owns the file: call :func:`remove_shm_pool` when done.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    nbytes = layout.pool_nbytes(num_blocks)
    try:
        path = create_pool_file(nbytes, directory, name)
    except OSError as exc:
        raise ValueError(f"cannot create a {nbytes} byte KV pool in {directory}: {exc}") from exc
    return map_shm_pool(layout, num_blocks, path, directory), path


def map_shm_pool(layout: KVLayout, num_blocks: int, path: str, directory: str = SHM_DIR) -> torch.Tensor:
    """Map an existing pool file; refuses what ``check_pool_path`` refuses and a file whose
    size does not match the layout."""
    check_pool_path(path, directory)
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
