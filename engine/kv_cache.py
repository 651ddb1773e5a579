"""The paged KV pool: one tensor holding K and V for every layer, block and slot.

Runs in each worker process. Layout ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]`` (index 0 of dim 1 = K, 1 = V), so one (layer, K|V, block) is a contiguous run of
bytes that kvtransfer can copy or send as is. On CPU the pool can live in a file under
/dev/shm mapped shared, so a prefill worker on the same host writes into it directly; that file
gets all its memory at creation (tandem_shm.pools.create_pool_file), so a full /dev/shm fails
the start, never a later write.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from engine.capacity import capacity_lines  # noqa: F401 - logged at startup
from tandem_shm.geometry import PoolGeometry
from tandem_shm.pools import SHM_DIR, create_pool_file, sweep_dead_pools


@dataclass(frozen=True)
class KVPoolShape:
    """The engine's view of one rank's pool (torch dtype); kvtransfer.KVLayout is the same
    geometry as the transfer fabric checks it (dtype by name, plus the TP rank). Both do their
    arithmetic in tandem_shm.geometry."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @cached_property
    def geometry(self) -> PoolGeometry:
        return PoolGeometry(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype.itemsize)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of K (or V) in one layer."""
        return self.geometry.block_nbytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across all layers, K and V."""
        return self.geometry.bytes_per_block


class KVPool:
    def __init__(self, layout: KVPoolShape, num_blocks: int, device: torch.device,
                 shared_memory: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = layout.geometry.pool_shape(num_blocks)
        numel = layout.geometry.pool_numel(num_blocks)
        self.shm_path: Path | None = None
        if shared_memory and device.type == "cpu":
            sweep_dead_pools()   # a SIGKILLed worker's pool still holds its whole size in RAM
            nbytes = layout.geometry.pool_nbytes(num_blocks)
            try:
                self.shm_path = Path(create_pool_file(nbytes))
                storage = torch.from_file(str(self.shm_path), shared=True, size=numel, dtype=layout.dtype)
            except OSError as exc:
                if self.shm_path is not None:
                    self.shm_path.unlink(missing_ok=True)
                raise RuntimeError(f"cannot map a {nbytes / 2**30:.2f} GiB KV pool in {SHM_DIR}: {exc}; "
                                   f"lower --kv-cache-memory or enlarge {SHM_DIR}") from exc
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
