"""The geometry of one TP rank's KV pool, torch-free (any worker process).

A pool is one contiguous array of shape ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]`` (index 0 of dim 1 = K, 1 = V), so one (layer, K|V, block) is a contiguous run of
``block_nbytes`` bytes. The engine's ``KVPoolShape`` (which sizes and allocates the pool) and
kvtransfer's ``KVLayout`` (which addresses it by byte offset and checks both ends agree) both
compute sizes and offsets here; they may not import each other, and their dtypes differ in
kind (a torch dtype, a wire name), so each gives its element size.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolGeometry:
    """Sizes and byte offsets in a pool of elements of ``itemsize`` bytes."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    itemsize: int

    @property
    def block_nbytes(self) -> int:
        """Bytes of one (layer, K|V, block) run."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across all layers, K and V."""
        return 2 * self.num_layers * self.block_nbytes

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def pool_numel(self, num_blocks: int) -> int:
        return self.num_layers * 2 * num_blocks * self.block_size * self.num_kv_heads * self.head_dim

    def pool_nbytes(self, num_blocks: int) -> int:
        return self.pool_numel(num_blocks) * self.itemsize

    def offset(self, layer: int, kv: int, block: int, num_blocks: int) -> int:
        """Byte offset of (layer, K|V, block) in a pool of ``num_blocks`` blocks."""
        # Row-major over [layer, kv, block]: each step of block is one block_nbytes run.
        return ((layer * 2 + kv) * num_blocks + block) * self.block_nbytes
