"""cuda-ipc backend: one-sided writes into a same-host receiver's GPU pool (both processes).

The receiver exports its pool's storage with ``UntypedStorage._share_cuda_()``; the handle's
bytes and ints travel in the descriptor (msgpack only, no Python object serialization). The sender opens it the way
torch's own ``rebuild_cuda_tensor`` (multiprocessing) does, copies blocks on its own
stream after the caller's compute for that layer, synchronizes, then sends ``WriteDone``.

CUDA refuses to open an IPC handle in the process that exported it ("invalid device
context"), so a sender in the receiver's own process finds the storage the way torch's
multiprocessing does for that case: export records a weak reference in torch's sharing
cache, keyed by (handle, offset), and open looks there before calling CUDA.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef, shared_cache, storage_from_cache

from .blockcopy import copy_blocks
from .descriptor import CudaIpcHandle, local_host_id
from .layout import KVLayout, flat_bytes
from .messages import WriteDone, encode
from .sender import Sender, SendFn


def export_cuda_pool(pool: torch.Tensor) -> CudaIpcHandle:
    """Receiver side: the IPC handle of the pool's CUDA storage."""
    if pool.device.type != "cuda":
        raise ValueError("cuda-ipc needs a CUDA pool")
    storage = pool.untyped_storage()
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    shared_cache[(bytes(handle), int(offset_bytes))] = StorageWeakRef(storage)
    return CudaIpcHandle(int(device), bytes(handle), int(size_bytes), int(offset_bytes),
                         bytes(ref_handle), int(ref_offset), bytes(event_handle), bool(event_sync),
                         int(pool.storage_offset()))


def open_cuda_pool(h: CudaIpcHandle, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """Sender side: map the receiver's pool; refuses a storage smaller than the layout."""
    shape = layout.pool_shape(num_blocks)
    needed = (h.tensor_offset + layout.pool_numel(num_blocks)) * layout.itemsize
    if h.storage_size_bytes < needed:
        raise ValueError(f"CUDA IPC storage is {h.storage_size_bytes} bytes, layout needs {needed}")
    storage = storage_from_cache(torch.UntypedStorage, (h.handle, h.storage_offset_bytes))
    if storage is None:   # another process's pool (or ours, already freed: CUDA then refuses)
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            h.device, h.handle, h.storage_size_bytes, h.storage_offset_bytes, h.ref_counter_handle,
            h.ref_counter_offset, h.event_handle, h.event_sync_required)
    stride = []
    acc = 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= dim
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=layout.torch_dtype,
                                       _internal=True)
    return torch._utils._rebuild_tensor(typed, h.tensor_offset, shape, tuple(reversed(stride)))


class CudaIpcWriter:
    def __init__(self, sender: Sender) -> None:
        d = sender.descriptor
        if "cuda-ipc" not in d.transports or d.cuda_ipc is None:
            raise ValueError("receiver does not offer the cuda-ipc transport")
        if d.host_id != local_host_id():
            raise ValueError("cuda-ipc pool is not on this host; use tcp")
        if sender.src_pool.device.type != "cuda":
            raise ValueError("cuda-ipc needs a CUDA source pool")
        self._layout = sender.layout
        self._src_flat = flat_bytes(sender.src_pool)
        self._src_num_blocks = sender.src_num_blocks
        self._dst_num_blocks = d.num_blocks
        self._dst_flat: torch.Tensor | None = flat_bytes(open_cuda_pool(d.cuda_ipc, d.layout, d.num_blocks))
        self._stream = torch.cuda.Stream(device=sender.src_pool.device)

    def capture(self) -> object:
        event = torch.cuda.Event()
        event.record()  # the caller's current stream: this layer's KV is ready when it fires
        return event

    def write(self, send: SendFn, ctx: object, request_id: str, layers: tuple[int, ...],
              src_block_ids: tuple[int, ...], dst_block_ids: tuple[int, ...]) -> None:
        assert isinstance(ctx, torch.cuda.Event) and self._dst_flat is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ctx)
            copy_blocks(self._layout, self._src_flat, self._src_num_blocks, self._dst_flat,
                        self._dst_num_blocks, layers, src_block_ids, dst_block_ids,
                        non_blocking=True)
        self._stream.synchronize()  # landed in the receiver's memory before we say so
        send([encode(WriteDone(request_id, layers, dst_block_ids))])

    def close(self) -> None:
        self._dst_flat = None
