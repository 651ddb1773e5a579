"""tcp backend: KV blocks as raw ZeroMQ frames to a receiver on any host (sender process).

A write goes out as messages of a few layers each (about ``MESSAGE_NBYTES``): a msgpack
``WritePayload`` header, then one frame per (layer, K|V) holding the blocks in dst order (at most
``max_frame_nbytes``: a long prompt's blocks go out over several messages). Frames
are sent zero-copy (``copy=False``): straight from the pool when the source blocks are one
consecutive run, otherwise from a staging buffer that is reused only after ZeroMQ reports it has
finished with it. The receiver validates the header and every frame size before scattering the
frames into its pool (``ReceiverCore``).
SNDHWM/RCVHWM bound the queues, so a slow receiver pushes back on the sender.
"""
from __future__ import annotations

import numpy as np
import torch
import zmq

from .blockcopy import runs
from .layout import flat_bytes
from .messages import WritePayload, encode, max_frame_nbytes
from .sender import Sender, SendFn

STAGING_SLOTS = 4
MESSAGE_NBYTES = 4 << 20  # group layers into messages of about this size: fewer headers to
                          # decode, still small enough that the receiver overlaps copy and recv


class StagingRing:
    """Reusable gather buffers; a slot whose bytes zmq may still read is replaced, not reused."""

    def __init__(self, slots: int = STAGING_SLOTS) -> None:
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._trackers: list[zmq.MessageTracker | None] = [None] * slots
        self._next = 0

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, int]:
        slot = self._next
        self._next = (slot + 1) % len(self._bufs)
        tracker = self._trackers[slot]
        buf = self._bufs[slot]
        if tracker is not None and not tracker.done:
            buf = None  # zmq still holds it; the frame keeps it alive, we take a fresh one
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            self._bufs[slot] = buf
        self._trackers[slot] = None
        return buf[:nbytes], slot

    def track(self, slot: int, tracker: zmq.MessageTracker) -> None:
        self._trackers[slot] = tracker


class TcpWriter:
    def __init__(self, sender: Sender) -> None:
        if "tcp" not in sender.descriptor.transports:
            raise ValueError("receiver does not offer the tcp transport")
        self._layout = sender.layout
        self._src_pool = sender.src_pool
        self._src_flat = flat_bytes(sender.src_pool)
        self._src_np = self._src_flat.numpy() if sender.src_pool.device.type == "cpu" else None
        self._src_num_blocks = sender.src_num_blocks
        self._staging = StagingRing()

    def capture(self) -> object:
        if self._src_pool.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()  # the caller's stream: bytes of this layer are ready once it fires
        return event

    def write(self, send: SendFn, ctx: object, request_id: str, layers: tuple[int, ...],
              src_block_ids: tuple[int, ...], dst_block_ids: tuple[int, ...]) -> None:
        # Several messages per write: the receiver scatters one while the next is on the wire.
        # A frame holds at most max_frame_nbytes (long prompts: the blocks are split over
        # messages); a message holds as many layers as fit in about MESSAGE_NBYTES.
        bn = self._layout.block_nbytes
        per_frame = max(1, max_frame_nbytes(bn) // bn)
        for b in range(0, len(src_block_ids), per_frame):
            src, dst = src_block_ids[b:b + per_frame], dst_block_ids[b:b + per_frame]
            contiguous = self._src_np is not None and len(runs(src)) <= 1
            per_message = max(1, MESSAGE_NBYTES // (2 * len(src) * bn))
            for i in range(0, len(layers), per_message):
                group = layers[i:i + per_message]
                header = encode(WritePayload(request_id, group, dst))
                if contiguous:
                    send([header, *(v for layer in group for v in self._views(layer, src))], copy=False)
                else:
                    self._send_staged(send, ctx, header, group, src)

    def _views(self, layer: int, src_block_ids: tuple[int, ...]) -> list:
        lo = self._layout
        first = src_block_ids[0] if src_block_ids else 0
        nbytes = len(src_block_ids) * lo.block_nbytes
        offs = [lo.offset(layer, kv, first, self._src_num_blocks) for kv in (0, 1)]
        assert self._src_np is not None   # only CPU pools send straight from the pool
        return [self._src_np[off:off + nbytes] for off in offs]

    def _send_staged(self, send: SendFn, ctx: object, header: bytes, layers: tuple[int, ...],
                     src_block_ids: tuple[int, ...]) -> None:
        frame_nbytes = len(src_block_ids) * self._layout.block_nbytes
        buf, slot = self._staging.acquire(2 * len(layers) * frame_nbytes)
        if isinstance(ctx, torch.cuda.Event):
            ctx.synchronize()  # CUDA source: wait for the layer's compute before reading
        for i, layer in enumerate(layers):
            self._gather(buf[2 * i * frame_nbytes:2 * (i + 1) * frame_nbytes], layer, src_block_ids)
        buf_np = buf.numpy()
        frames = [header] + [buf_np[i * frame_nbytes:(i + 1) * frame_nbytes]
                             for i in range(2 * len(layers))]
        self._staging.track(slot, send(frames, copy=False, track=True))

    def _gather(self, buf: torch.Tensor, layer: int, src_block_ids: tuple[int, ...]) -> None:
        lo = self._layout
        src4 = self._src_flat.view(lo.num_layers, 2, self._src_num_blocks, lo.block_nbytes)
        out = buf.view(2, len(src_block_ids), lo.block_nbytes)
        idx = torch.tensor(src_block_ids, dtype=torch.int64, device=src4.device)
        if src4.device.type == "cpu":
            np.take(src4[layer].numpy(), idx.numpy(), axis=1, out=out.numpy())
        else:
            out.copy_(src4[layer].index_select(1, idx))  # device → host

    def close(self) -> None:
        self._staging = StagingRing()
