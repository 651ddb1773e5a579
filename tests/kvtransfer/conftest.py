"""Shared fixtures for kvtransfer tests: a tiny layout, poisoned pools, per-backend pairs."""
from __future__ import annotations

import os

import pytest
import torch

from kvtransfer import FakeFabric, KVLayout, create_receiver, create_sender
from kvtransfer.region import create_shm_pool, remove_shm_pool

POISON = 0xA5
DST_BLOCKS = 16
SRC_BLOCKS = 12
CONTRACT_BACKENDS = ["fake", "shm", "tcp", "cuda-ipc", "nixl"]
HAS_CUDA = torch.cuda.is_available()
# nixl runs over UCX's TCP transport on loopback here, as it would between nodes (on one host UCX
# would otherwise pick shared memory). Child processes of the tests inherit it.
os.environ.setdefault("UCX_TLS", "tcp,self")


def has_nixl() -> bool:
    try:
        from kvtransfer.nixl import bindings
        bindings()
    except ImportError:
        return False
    return True


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


@pytest.fixture
def layout() -> KVLayout:
    # block_nbytes = 4 tokens * 2 heads * 8 dims * 2 bytes = 128
    return KVLayout("bfloat16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def u8(pool: torch.Tensor) -> torch.Tensor:
    """Byte view of a pool with the [layer, kv, block] dims kept; on the CPU."""
    return pool.detach().cpu().contiguous().view(torch.uint8)


def random_pool(layout: KVLayout, num_blocks: int, seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (layout.pool_nbytes(num_blocks),), dtype=torch.uint8, generator=gen)
    return raw.view(layout.torch_dtype).view(layout.pool_shape(num_blocks)).to(device)


class Pair:
    """A receiver with a poisoned pool, plus a factory for senders of one backend."""

    def __init__(self, backend: str, layout: KVLayout, lease_s: float = 5.0) -> None:
        self.backend = backend
        self.layout = layout
        self.device = "cuda" if backend == "cuda-ipc" else "cpu"
        self.fabric = FakeFabric() if backend == "fake" else None
        self.shm_path = None
        if backend == "shm":
            self.dst, self.shm_path = create_shm_pool(layout, DST_BLOCKS)
        else:
            self.dst = torch.empty(layout.pool_shape(DST_BLOCKS), dtype=layout.torch_dtype,
                                   device=self.device)
        self.dst.view(torch.uint8).fill_(POISON)
        self.expected = u8(self.dst).clone()
        self.src = random_pool(layout, SRC_BLOCKS, seed=1234, device=self.device)
        self.receiver = create_receiver(self.dst, layout, backend, shm_path=self.shm_path,
                                        lease_s=lease_s, fabric=self.fabric)
        self.senders: list = []

    def sender(self, heartbeat_s: float = 0.1, src: torch.Tensor | None = None):
        s = create_sender(self.receiver.descriptor.to_bytes(), self.src if src is None else src,
                          self.layout, self.backend, heartbeat_s=heartbeat_s, fabric=self.fabric)
        self.senders.append(s)
        return s

    def land(self, layers, src_block_ids, dst_block_ids, src: torch.Tensor | None = None) -> None:
        """Record what a successful write must have put in the pool."""
        src_u8 = u8(self.src if src is None else src)
        for layer in layers:
            self.expected[layer, :, list(dst_block_ids)] = src_u8[layer, :, list(src_block_ids)]

    def assert_pool(self) -> None:
        assert torch.equal(u8(self.dst), self.expected)

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self.receiver.close()
        if self.shm_path:
            remove_shm_pool(self.shm_path)


def make_pair(backend: str, layout: KVLayout, lease_s: float = 5.0) -> Pair:
    if backend == "cuda-ipc" and not HAS_CUDA:
        pytest.skip("cuda-ipc needs a CUDA device; torch.cuda.is_available() is False here")
    if backend == "nixl" and not has_nixl():
        pytest.skip("NIXL is not installed (bash scripts/setup.sh --nixl)")
    return Pair(backend, layout, lease_s)


@pytest.fixture(params=CONTRACT_BACKENDS)
def pair(request: pytest.FixtureRequest, layout: KVLayout):
    p = make_pair(request.param, layout)
    yield p
    p.close()


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
