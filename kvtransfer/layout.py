"""KV pool layout: the geometry both ends of a transfer must agree on (any worker process).

The engine's pool is one contiguous tensor of shape
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V), so one
(layer, K|V, block) is a contiguous run of ``block_nbytes`` bytes. Everything in kvtransfer
addresses the pool by byte offset through :meth:`KVLayout.offset`. The arithmetic is
tandem_shm.geometry's, which the engine's pool uses too; this adds the dtype's wire name, the TP
rank, validation of what arrives from a socket, and the torch side.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import torch

from tandem_shm.geometry import PoolGeometry

# Wire names of the dtypes a pool may hold; the name travels in descriptors, never the object.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
MAX_DIM = 1 << 20  # bound on every geometry field, so descriptors from a socket stay sane


class LayoutMismatchError(ValueError):
    """The sender's pool layout differs from the receiver's; nothing is written."""


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one TP rank's KV pool, independent of how many blocks it holds."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {sorted(DTYPES)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= MAX_DIM:
                raise ValueError(f"{name} must be an int in [1, {MAX_DIM}], got {value!r}")
        if type(self.tp_rank) is not int or not 0 <= self.tp_rank < 4096:
            raise ValueError(f"tp_rank must be an int in [0, 4096), got {self.tp_rank!r}")

    @classmethod
    def from_dtype(cls, dtype: torch.dtype, **kwargs: int) -> KVLayout:
        names = {v: k for k, v in DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return cls(dtype=names[dtype], **kwargs)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @cached_property
    def geometry(self) -> PoolGeometry:
        return PoolGeometry(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.itemsize)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one (layer, K|V, block) run."""
        return self.geometry.block_nbytes

    @classmethod
    def of_pool(cls, pool: torch.Tensor, tp_rank: int = 0) -> KVLayout:
        """The layout of a ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` pool."""
        if pool.dim() != 6 or pool.shape[1] != 2:
            raise ValueError(f"a KV pool is [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
                             f"got {tuple(pool.shape)}")
        names = {dtype: name for name, dtype in DTYPES.items()}
        if pool.dtype not in names:
            raise ValueError(f"KV pool dtype {pool.dtype} is not supported; use one of {sorted(DTYPES)}")
        num_layers, _, _, block_size, num_kv_heads, head_dim = pool.shape
        return cls(names[pool.dtype], block_size, num_layers, num_kv_heads, head_dim, tp_rank)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.geometry.pool_shape(num_blocks)

    def pool_numel(self, num_blocks: int) -> int:
        return self.geometry.pool_numel(num_blocks)

    def pool_nbytes(self, num_blocks: int) -> int:
        return self.geometry.pool_nbytes(num_blocks)

    def offset(self, layer: int, kv: int, block: int, num_blocks: int) -> int:
        """Byte offset of (layer, K|V, block) in a pool of ``num_blocks`` blocks."""
        return self.geometry.offset(layer, kv, block, num_blocks)

    def check_compatible(self, other: KVLayout) -> None:
        """Raise :class:`LayoutMismatchError` naming every field that differs."""
        diffs = [f"{f.name}: ours={getattr(self, f.name)!r} theirs={getattr(other, f.name)!r}"
                 for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if diffs:
            raise LayoutMismatchError("KV layout mismatch, refusing to transfer: " + "; ".join(diffs))

    def check_pool(self, pool: torch.Tensor) -> int:
        """Validate that ``pool`` is a pool of this layout; return its ``num_blocks``."""
        if pool.dim() != 6:
            raise ValueError(f"KV pool must have 6 dims {self.pool_shape(0)[:2]}+..., got {tuple(pool.shape)}")
        num_blocks = pool.shape[2]
        if tuple(pool.shape) != self.pool_shape(num_blocks):
            raise ValueError(f"KV pool shape {tuple(pool.shape)} does not match layout "
                             f"{self.pool_shape(num_blocks)} (num_blocks={num_blocks})")
        if pool.dtype != self.torch_dtype:
            raise ValueError(f"KV pool dtype {pool.dtype} does not match layout dtype {self.dtype}")
        if not pool.is_contiguous():
            raise ValueError("KV pool must be one contiguous tensor")
        if num_blocks < 1:
            raise ValueError("KV pool must hold at least one block")
        return num_blocks


def flat_bytes(pool: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous pool (CPU or CUDA), sharing its memory."""
    return pool.reshape(-1).view(torch.uint8)
