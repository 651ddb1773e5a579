"""Region descriptor: what a receiver hands out so senders can reach its KV pool (any process).

Serialized as a msgpack array with bounded fields (it crosses the control plane), decoded
only into :class:`RegionDescriptor`. It carries the layout, the pool's block count, which
transports the receiver accepts, its ZeroMQ endpoint and, per transport, the shm path, the
CUDA IPC handle fields or the NIXL agent's metadata blob and the pool's address. No Python
object serialization: the CUDA handle is sent as bytes and ints, the NIXL metadata as NIXL's
own bytes (handed to its ``loadRemoteMD`` as they are).
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack

from .layout import MAX_DIM, KVLayout
from .messages import MessageError

TRANSPORTS = ("shm", "tcp", "cuda-ipc", "nixl", "fake")
ONE_SIDED = frozenset({"shm", "cuda-ipc", "nixl", "fake"})  # sender writes the pool itself
VERSION = 2   # 2: the nixl region field
MAX_DESCRIPTOR_BYTES = 256 << 10
_MAX_STR = 1024
_MAX_HANDLE = 64 << 10  # torch's IPC handle grows with expandable segments


@dataclass(frozen=True)
class CudaIpcHandle:
    """Fields of ``UntypedStorage._share_cuda_()`` for the pool's storage, plus the tensor view."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int          # elements, into the storage


@dataclass(frozen=True)
class NixlRegion:
    """What a NIXL sender needs to write the receiver's pool: the receiver agent's metadata
    (``getLocalMD()``: its UCX worker address and the pool's remote keys) and the pool's
    registered memory, so block offsets become remote addresses."""

    agent_metadata: bytes
    base_addr: int               # the pool's first byte in the receiver's address space
    device_id: int               # CUDA device of a VRAM pool; 0 for DRAM
    mem_type: str                # "DRAM" or "VRAM"


NIXL_MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class RegionDescriptor:
    layout: KVLayout
    num_blocks: int
    transports: tuple[str, ...]
    address: str                 # ZeroMQ endpoint of the receiver's control/data socket
    host_id: str                 # hostname + boot id: "same host" test for shm / cuda-ipc
    region_id: str               # random per registration
    shm_path: str | None = None
    cuda_ipc: CudaIpcHandle | None = None
    curve_public_key: bytes | None = None   # Z85 server key when CurveZMQ is on
    nixl: NixlRegion | None = None

    def to_bytes(self) -> bytes:
        lo = self.layout
        c = self.cuda_ipc
        cuda = None if c is None else [
            c.device, c.handle, c.storage_size_bytes, c.storage_offset_bytes, c.ref_counter_handle,
            c.ref_counter_offset, c.event_handle, c.event_sync_required, c.tensor_offset]
        n = self.nixl
        nixl = None if n is None else [n.agent_metadata, n.base_addr, n.device_id, n.mem_type]
        data = msgpack.packb([
            VERSION, [lo.dtype, lo.block_size, lo.num_layers, lo.num_kv_heads, lo.head_dim, lo.tp_rank],
            self.num_blocks, list(self.transports), self.address, self.host_id, self.region_id,
            self.shm_path, cuda, self.curve_public_key, nixl], use_bin_type=True)
        return data

    @classmethod
    def from_bytes(cls, data: bytes) -> RegionDescriptor:
        if len(data) > MAX_DESCRIPTOR_BYTES:
            raise MessageError("oversize", "descriptor")
        try:
            obj = msgpack.unpackb(data, raw=False, max_str_len=_MAX_STR, max_bin_len=_MAX_HANDLE,
                                  max_array_len=16, max_map_len=0, max_ext_len=0)
        except Exception as exc:
            raise MessageError("malformed", f"descriptor: {type(exc).__name__}") from None
        if not isinstance(obj, list) or len(obj) != 11 or obj[0] != VERSION:
            raise MessageError("malformed", "descriptor shape or version")
        _, lo, num_blocks, transports, address, host_id, region_id, shm_path, cuda, key, nixl = obj
        try:
            layout = KVLayout(*_typed(lo, (str, int, int, int, int, int), "layout"))
        except ValueError as exc:
            raise MessageError("bad_field", f"layout: {exc}") from None
        if type(num_blocks) is not int or not 1 <= num_blocks <= MAX_DIM * 64:
            raise MessageError("bad_field", "num_blocks")
        if (not isinstance(transports, list) or not transports
                or any(t not in TRANSPORTS for t in transports)):
            raise MessageError("bad_field", "transports")
        for name, value in (("address", address), ("host_id", host_id), ("region_id", region_id)):
            if type(value) is not str:
                raise MessageError("bad_field", name)
        if shm_path is not None and type(shm_path) is not str:
            raise MessageError("bad_field", "shm_path")
        if key is not None and (type(key) is not bytes or len(key) != 40):
            raise MessageError("bad_field", "curve_public_key")
        handle = None if cuda is None else CudaIpcHandle(*_typed(
            cuda, (int, bytes, int, int, bytes, int, bytes, bool, int), "cuda_ipc"))
        region = None if nixl is None else NixlRegion(*_typed(nixl, (bytes, int, int, str), "nixl"))
        if region is not None and (region.mem_type not in NIXL_MEM_TYPES or not region.agent_metadata):
            raise MessageError("bad_field", "nixl")
        return cls(layout, num_blocks, tuple(transports), address, host_id, region_id,
                   shm_path, handle, key, region)


def _typed(values: object, types: tuple[type, ...], name: str) -> list:
    if not isinstance(values, list) or len(values) != len(types):
        raise MessageError("bad_field", name)
    for v, t in zip(values, types):
        if type(v) is not t or (isinstance(v, int) and v < 0):
            raise MessageError("bad_field", name)
    return values


def local_host_id() -> str:
    """Identify this host (and boot), so 'same host' survives container hostname reuse."""
    import socket
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


MAX_TP_RANKS = 64
_SET_TAG = "tp"


def join_descriptors(per_rank: list[bytes]) -> bytes:
    """The regions of one tensor-parallel replica, in rank order, as one descriptor blob (what
    a decode worker hands a prefill worker). A single rank's descriptor stays as it is."""
    if not 1 <= len(per_rank) <= MAX_TP_RANKS:
        raise ValueError(f"a replica has 1..{MAX_TP_RANKS} ranks, got {len(per_rank)} descriptors")
    if len(per_rank) == 1:
        return bytes(per_rank[0])
    return msgpack.packb([_SET_TAG, [bytes(d) for d in per_rank]], use_bin_type=True)


def split_descriptors(data: bytes) -> list[bytes]:
    """Per-rank descriptors of a blob from :func:`join_descriptors` (one for TP=1). Each entry
    still goes through :meth:`RegionDescriptor.from_bytes` before use."""
    if len(data) > MAX_DESCRIPTOR_BYTES:
        raise MessageError("oversize", "descriptor set")
    try:
        obj = msgpack.unpackb(data, raw=False, max_str_len=_MAX_STR, max_bin_len=MAX_DESCRIPTOR_BYTES,
                              max_array_len=MAX_TP_RANKS, max_map_len=0, max_ext_len=0)
    except Exception as exc:
        raise MessageError("malformed", f"descriptor: {type(exc).__name__}") from None
    if not (isinstance(obj, list) and len(obj) == 2 and obj[0] == _SET_TAG):
        return [bytes(data)]   # one rank's descriptor
    ranks = obj[1]
    if (not isinstance(ranks, list) or not 2 <= len(ranks) <= MAX_TP_RANKS
            or any(type(d) is not bytes for d in ranks)):
        raise MessageError("bad_field", "descriptor set")
    return ranks
