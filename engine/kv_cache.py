"""The paged KV pool: one tensor holding K and V for every layer, block and slot.

Runs in each worker process. Layout ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]`` (index 0 of dim 1 = K, 1 = V), so one (layer, K|V, block) is a contiguous run of
bytes that kvtransfer can copy or send as is. On CPU the pool can live in a file under
/dev/shm mapped shared, so a prefill worker on the same host writes into it directly; that file
gets all its memory at creation (``reserve_shm``), so a full /dev/shm fails the start, never a
later write.
"""
from __future__ import annotations

import errno
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.capacity import capacity_lines  # noqa: F401 - logged at startup

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "tandem-kv-"   # then "<pid>-<random>": the owner's pid, so stale pools can be found;
#                            kvtransfer.region.POOL_NAME only opens names of this form (a test holds them together)


def reserve_shm(fd: int, nbytes: int, directory: Path) -> None:
    """Give a new pool file all ``nbytes`` of memory now, or raise OSError (ENOSPC). A sparse
    file on a full tmpfs maps fine and then kills the process with SIGBUS at the first write to
    a page it cannot back -- in the middle of serving, and in the prefill worker writing into it."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise OSError(errno.ENOSPC, f"{nbytes / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free in {directory}")
    os.posix_fallocate(fd, 0, nbytes)


def sweep_stale_pools(directory: Path = SHM_DIR) -> list[Path]:
    """Remove pools whose owning process is gone (a worker killed with SIGKILL cannot unlink
    its own, and each one holds its whole size in RAM). Returns what was removed."""
    removed = []
    for path in directory.glob(f"{SHM_PREFIX}*"):
        pid_text = path.name[len(SHM_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path)
            logger.info("removed stale KV pool %s (its process %s is gone)", path, pid_text)
        except PermissionError:
            continue  # alive, another user's
    return removed


@dataclass(frozen=True)
class KVPoolShape:
    """The engine's view of one rank's pool (torch dtype); kvtransfer.KVLayout is the same
    geometry as the transfer fabric checks it (dtype by name, plus the TP rank)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of K (or V) in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across all layers, K and V."""
        return 2 * self.num_layers * self.block_nbytes


class KVPool:
    def __init__(self, layout: KVPoolShape, num_blocks: int, device: torch.device,
                 shared_memory: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
                 layout.head_dim)
        numel = 1
        for dim in shape:
            numel *= dim
        self.shm_path: Path | None = None
        if shared_memory and device.type == "cpu":
            sweep_stale_pools()
            self.shm_path = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
            nbytes = numel * layout.dtype.itemsize
            try:
                # 0600: the pool holds every request's KV; only this user's processes may map it.
                fd = os.open(self.shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb"):
                    os.fchmod(fd, 0o600)   # whatever the umask
                    reserve_shm(fd, nbytes, SHM_DIR)
                storage = torch.from_file(str(self.shm_path), shared=True, size=numel, dtype=layout.dtype)
            except OSError as exc:
                self.shm_path.unlink(missing_ok=True)
                raise RuntimeError(f"cannot map a {nbytes / 2**30:.2f} GiB KV pool in {SHM_DIR}: {exc}; "
                                   "lower --kv-cache-memory or enlarge /dev/shm") from exc
            self.tensor = storage.view(shape)
        else:
            self.tensor = torch.zeros(shape, dtype=layout.dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) views ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return [(self.tensor[layer, 0], self.tensor[layer, 1]) for layer in range(self.layout.num_layers)]

    def close(self) -> None:
        """Unlink the shared-memory file; mappings already open stay valid until dropped."""
        if self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)
            self.shm_path = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
