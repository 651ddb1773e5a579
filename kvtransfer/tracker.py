"""Per-request transfer state on the receiver: expected blocks, landed layers, leases.

Runs in the receiver's process; not thread-safe by itself (``ReceiverCore`` holds the lock).
A request is expected with its destination block ids and layer count, moves
WAITING → TRANSFERRING on the first sign of its sender, and ends DONE (every (layer, block)
landed and the notify arrived), FAILED (lease ran out: no sender activity for ``lease_s``)
or CANCELLED (either side). Its blocks stay owned until :meth:`RequestTable.release`, and a
terminal request reports ``blocks_freeable`` only when no writer can still touch them.

When the receiver hands a request to another writer (failover to a new prefill worker),
:meth:`RequestTable.fence` starts a new epoch: what landed so far no longer counts, and every
writer seen so far is fenced -- its writes (rejected before a byte is copied on tcp), notifies,
heartbeats and cancels for that request are refused from then on, so a late writer can neither
complete, renew nor cancel the new writer's transfer.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .messages import MAX_BLOCK_IDS, MAX_REQUEST_ID_LEN, MessageError, NotifyPayload

MAX_REQUESTS = 1 << 16
MAX_PEERS_PER_REQUEST = 8


class TransferStatus(enum.Enum):
    WAITING = "waiting"            # expected, nothing from a sender yet
    TRANSFERRING = "transferring"  # sender active, not all layers + notify landed
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (TransferStatus.DONE, TransferStatus.FAILED, TransferStatus.CANCELLED)


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    status: TransferStatus
    dst_block_ids: tuple[int, ...]
    num_layers: int
    landed_layers: tuple[int, ...]      # layers whose every destination block has landed
    payload: NotifyPayload | None
    reason: str
    blocks_freeable: bool               # terminal and no writer can still touch the blocks


@dataclass
class _Request:
    request_id: str
    dst_block_ids: tuple[int, ...]
    column: dict[int, int]              # dst block id -> column of `landed`
    landed: np.ndarray                  # bool [num_layers, len(dst_block_ids)]
    lease_s: float
    deadline: float
    status: TransferStatus = TransferStatus.WAITING
    payload: NotifyPayload | None = None
    reason: str = ""
    peers: set[bytes] = field(default_factory=set)
    acks_pending: set[bytes] = field(default_factory=set)
    free_at: float | None = None        # cancelled, waiting for acks: freeable from this time on
    epoch: int = 0                      # writers handed this request so far, minus one
    fenced: set[bytes] = field(default_factory=set)   # writers of earlier epochs


class RequestTable:
    def __init__(self, num_blocks: int, max_layers: int, one_sided: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._num_blocks = num_blocks
        self._max_layers = max_layers
        self._one_sided = one_sided     # a sender may write our pool without asking us
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._owner: dict[int, str] = {}

    # -- receiver API -------------------------------------------------------------------------
    def expect(self, request_id: str, dst_block_ids: Sequence[int], num_layers: int,
               lease_s: float) -> None:
        if type(request_id) is not str or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
            raise ValueError(f"request_id must be a non-empty str of <= {MAX_REQUEST_ID_LEN} chars")
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already tracked; release() it first")
        if len(self._requests) >= MAX_REQUESTS:
            raise ValueError(f"too many tracked requests ({MAX_REQUESTS}); release finished ones")
        ids = tuple(int(b) for b in dst_block_ids)
        if len(ids) > MAX_BLOCK_IDS or len(set(ids)) != len(ids):
            raise ValueError(f"dst_block_ids must be unique and at most {MAX_BLOCK_IDS}")
        bad = [b for b in ids if not 0 <= b < self._num_blocks]
        if bad:
            raise ValueError(f"dst_block_ids {bad[:8]} out of range [0, {self._num_blocks})")
        taken = [b for b in ids if b in self._owner]
        if taken:
            raise ValueError(f"dst blocks {taken[:8]} already belong to request_id="
                             f"{self._owner[taken[0]]!r}")
        if not 1 <= num_layers <= self._max_layers:
            raise ValueError(f"num_layers must be in [1, {self._max_layers}], got {num_layers}")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self._requests[request_id] = _Request(
            request_id, ids, {b: i for i, b in enumerate(ids)},
            np.zeros((num_layers, len(ids)), dtype=bool), lease_s, self._clock() + lease_s)
        for b in ids:
            self._owner[b] = request_id

    def cancel(self, request_id: str, reason: str) -> list[bytes]:
        """Cancel locally; return the peers that must be told to stop writing."""
        req = self._get(request_id)
        if req.status.terminal:
            return []
        self._finish(req, TransferStatus.CANCELLED, reason)
        if not self._one_sided:
            return []  # every byte passes through us: nothing lands after this point
        # A one-sided sender may still be copying: free only after it acks, or after a lease.
        req.acks_pending = set(req.peers)
        req.free_at = self._clock() + req.lease_s
        return sorted(req.peers)

    def fence(self, request_id: str) -> list[bytes]:
        """Hand an unfinished request to a new writer: a new epoch, nothing landed, its lease
        renewed, every writer so far fenced. Returns the fenced peers (to be told to stop)."""
        req = self._get(request_id)
        if req.status.terminal:
            raise ValueError(f"request_id={request_id!r} is {req.status.value}; only an unfinished one moves")
        old = sorted(req.peers)
        req.fenced |= req.peers
        req.peers = set()
        req.epoch += 1
        req.landed[:] = False
        req.payload = None
        req.status = TransferStatus.WAITING
        req.deadline = self._clock() + req.lease_s
        return old

    def result(self, request_id: str) -> TransferResult:
        req = self._get(request_id)
        layers = tuple(int(i) for i in np.flatnonzero(req.landed.all(axis=1)))
        return TransferResult(req.request_id, req.status, req.dst_block_ids, req.landed.shape[0],
                              layers, req.payload, req.reason, self._freeable(req))

    def finished(self) -> list[str]:
        return [r.request_id for r in self._requests.values() if self._freeable(r)]

    def release(self, request_id: str) -> tuple[int, ...]:
        req = self._get(request_id)
        if not self._freeable(req):
            raise ValueError(f"request_id={request_id!r} is {req.status.value} and its blocks "
                             "may still be written; wait for blocks_freeable")
        del self._requests[request_id]
        for b in req.dst_block_ids:
            del self._owner[b]
        return req.dst_block_ids

    def expire(self) -> bool:
        """Fail requests whose lease ran out; return whether anything changed."""
        now = self._clock()
        changed = False
        for req in self._requests.values():
            if not req.status.terminal and now >= req.deadline:
                self._finish(req, TransferStatus.FAILED,
                             f"lease expired: no sender activity for {req.lease_s:g} s")
                changed = True
            elif req.free_at is not None and now >= req.free_at:
                req.free_at, req.acks_pending = None, set()
                changed = True
        return changed

    def next_deadline(self) -> float | None:
        times = [r.deadline for r in self._requests.values() if not r.status.terminal]
        times += [r.free_at for r in self._requests.values() if r.free_at is not None]
        return min(times, default=None)

    # -- sender messages ----------------------------------------------------------------------
    def check_write(self, peer: bytes, request_id: str, layers: Sequence[int],
                    dst_block_ids: Sequence[int]) -> _Request:
        """Validate a write fully before any byte of it is copied."""
        req = self._active(peer, request_id)
        num_layers = req.landed.shape[0]
        if not layers or max(layers) >= num_layers:
            raise MessageError("layer_out_of_range", f"request_id={request_id} has {num_layers}")
        if dst_block_ids and max(dst_block_ids) >= self._num_blocks:
            raise MessageError("out_of_range_block", f"request_id={request_id}")
        if not req.column.keys() >= set(dst_block_ids):
            raise MessageError("block_not_in_request", f"request_id={request_id}")
        return req

    def mark_landed(self, peer: bytes, req: _Request, layers: Sequence[int],
                    dst_block_ids: Sequence[int]) -> None:
        rows = np.asarray(layers, dtype=np.int64)[:, None]
        if tuple(dst_block_ids) == req.dst_block_ids:
            req.landed[rows, :] = True  # the common case: the whole request's blocks
        else:
            cols = np.fromiter(map(req.column.__getitem__, dst_block_ids), np.int64)
            req.landed[rows, cols[None, :]] = True
        self._touch(req, peer)
        self._maybe_done(req)

    def notify(self, peer: bytes, request_id: str, payload: NotifyPayload) -> None:
        req = self._active(peer, request_id)
        req.payload = payload
        self._touch(req, peer)
        self._maybe_done(req)

    def heartbeat(self, peer: bytes, request_ids: Sequence[str]) -> list[str]:
        """Renew leases; return the ids this peer should stop working on."""
        stale = []
        for request_id in request_ids:
            req = self._requests.get(request_id)
            if req is None or req.status.terminal or peer in req.fenced:
                stale.append(request_id)
            else:
                self._touch(req, peer)
        return stale

    def cancelled_by_sender(self, peer: bytes, request_id: str, reason: str) -> None:
        req = self._get_known(request_id)
        if peer in req.fenced:
            return   # a fenced writer giving up: it no longer speaks for this request
        if not req.status.terminal:
            # The sender sends this after its last write to us, so no write can follow it.
            self._finish(req, TransferStatus.CANCELLED, f"cancelled by sender: {reason}")
        elif req.free_at is not None:
            # We cancelled first (both sides were told to abort): for the same reason this
            # counts as the sender's ack, so the blocks need not wait for the lease.
            self.acked(peer, request_id)

    def acked(self, peer: bytes, request_id: str) -> None:
        req = self._get_known(request_id)
        req.acks_pending.discard(peer)
        if req.free_at is not None and not req.acks_pending:
            req.free_at = None

    # -- internals ----------------------------------------------------------------------------
    def _get(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"request_id={request_id!r} is not tracked")
        return req

    def _get_known(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise MessageError("unknown_request", f"request_id={request_id}")
        return req

    def _active(self, peer: bytes, request_id: str) -> _Request:
        req = self._get_known(request_id)
        if req.status.terminal:
            raise MessageError("inactive_request", f"request_id={request_id} is {req.status.value}")
        if peer in req.fenced:
            raise MessageError("fenced_writer", f"request_id={request_id} moved to another writer")
        return req

    def _touch(self, req: _Request, peer: bytes) -> None:
        if req.status is TransferStatus.WAITING:
            req.status = TransferStatus.TRANSFERRING
        if len(req.peers) < MAX_PEERS_PER_REQUEST:
            req.peers.add(peer)
        req.deadline = self._clock() + req.lease_s

    def _maybe_done(self, req: _Request) -> None:
        if req.payload is not None and req.landed.all():
            self._finish(req, TransferStatus.DONE, "")

    @staticmethod
    def _finish(req: _Request, status: TransferStatus, reason: str) -> None:
        req.status, req.reason = status, reason

    @staticmethod
    def _freeable(req: _Request) -> bool:
        return req.status.terminal and req.free_at is None
