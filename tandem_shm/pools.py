"""Tandem's shared-memory KV pool files: their directory, their names, creating one, and removing
the pools of processes that are gone. Standard library only.

A CPU worker's KV pool is a file in ``SHM_DIR`` mapped shared (engine/kv_cache.py), so a same-host
prefill worker maps the same file and writes blocks into it one-sidedly (kvtransfer/region.py,
which also makes pools for its tests and benchmarks). Both create pools here, and the launchers
(deploy/launch.py, engine/tp/spawn.py) remove a dead child's pools here. A leaf below engine and
kvtransfer, which may not import each other (docs/architecture.md#packages-and-import-direction).

A pool file is named ``POOL_PREFIX<owner pid>-<12 hex digits>`` (``POOL_NAME``): the pid lets a
launcher or a later worker find the pools of a process that died without unlinking its own (a
SIGKILL), each of which holds its whole size in RAM. It is 0600 (the pool holds every request's
KV), and gets all its memory when it is created (a free-space check, then posix_fallocate): a
sparse file on a full tmpfs maps fine and then SIGBUSes whoever first writes a page it cannot
back, in the middle of serving.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
POOL_PREFIX = "tandem-kv-"
POOL_NAME = re.compile(re.escape(POOL_PREFIX) + r"[0-9]{1,10}-[0-9a-f]{12}")


def pool_name(pid: int | None = None) -> str:
    """A fresh pool file name for process ``pid`` (default: this one)."""
    return f"{POOL_PREFIX}{os.getpid() if pid is None else pid}-{uuid.uuid4().hex[:12]}"


def create_pool_file(nbytes: int, directory: str | os.PathLike = SHM_DIR, name: str | None = None) -> str:
    """Create the pool file ``directory/name`` (default: a fresh ``pool_name()``), 0600 whatever
    the umask, with all ``nbytes`` backed by memory; return its path. OSError (ENOSPC when it
    does not fit) leaves no file behind. The caller maps it and owns it (unlink when done)."""
    name = pool_name() if name is None else name
    if not POOL_NAME.fullmatch(name):
        raise ValueError(f"pool name {name!r} does not match {POOL_NAME.pattern}: use pool_name()")
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        free = (st := os.statvfs(directory)).f_bavail * st.f_frsize
        if nbytes > free:
            raise OSError(errno.ENOSPC, f"{nbytes / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free in {directory}")
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


def _owner(path: Path) -> int | None:
    pid_text = path.name[len(POOL_PREFIX):].split("-", 1)[0]
    return int(pid_text) if pid_text.isdigit() else None


def pools_of(pid: int, directory: str | os.PathLike = SHM_DIR) -> list[Path]:
    """The pool files of process ``pid``."""
    return sorted(Path(directory).glob(f"{POOL_PREFIX}{pid}-*"))


def remove_pools_of(pid: int, directory: str | os.PathLike = SHM_DIR) -> list[Path]:
    """Remove the pools of process ``pid``, a child that died (a launcher's cleanup: a live
    process's pool would be unlinked under it). Returns what was removed."""
    removed = pools_of(pid, directory)
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def sweep_dead_pools(directory: str | os.PathLike = SHM_DIR) -> list[Path]:
    """Remove the pools whose owning process is gone. Returns what was removed."""
    removed = []
    for path in sorted(Path(directory).glob(f"{POOL_PREFIX}*")):
        pid = _owner(path)
        if pid is None:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path)
            logger.info("removed stale KV pool %s (its process %d is gone)", path, pid)
        except PermissionError:
            continue  # alive, another user's
    return removed
