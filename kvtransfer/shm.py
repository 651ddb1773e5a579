"""shm backend: one-sided writes into a same-host receiver's /dev/shm pool (sender process).

The sender maps the receiver's pool file and copies blocks straight into the destination;
only a small ``WriteDone`` message goes over ZeroMQ, after the bytes have landed. The path is
checked to be a Tandem pool before it is mapped (``region.check_pool_path``).
"""
from __future__ import annotations

import torch

from .blockcopy import copy_blocks
from .descriptor import local_host_id
from .layout import flat_bytes
from .messages import WriteDone, encode
from .region import map_shm_pool
from .sender import Sender, SendFn


class ShmWriter:
    def __init__(self, sender: Sender) -> None:
        d = sender.descriptor
        if "shm" not in d.transports or not d.shm_path:
            raise ValueError("receiver does not offer the shm transport")
        if d.host_id != local_host_id():
            raise ValueError(f"shm pool {d.shm_path} is not on this host; use tcp")
        if sender.src_pool.device.type != "cpu":
            raise ValueError("shm needs a CPU source pool; use cuda-ipc or tcp")
        self._layout = sender.layout
        self._src_flat = flat_bytes(sender.src_pool)
        self._src_num_blocks = sender.src_num_blocks
        self._dst_num_blocks = d.num_blocks
        self._dst_flat: torch.Tensor | None = flat_bytes(map_shm_pool(d.layout, d.num_blocks, d.shm_path))

    def capture(self) -> None:
        return None

    def write(self, send: SendFn, ctx: object, request_id: str, layers: tuple[int, ...],
              src_block_ids: tuple[int, ...], dst_block_ids: tuple[int, ...]) -> None:
        assert self._dst_flat is not None, "write after close"
        copy_blocks(self._layout, self._src_flat, self._src_num_blocks, self._dst_flat,
                    self._dst_num_blocks, layers, src_block_ids, dst_block_ids)
        send([encode(WriteDone(request_id, layers, dst_block_ids))])

    def close(self) -> None:
        self._dst_flat = None  # drop the mapping
