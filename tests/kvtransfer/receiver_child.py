"""A nixl receiver in its own process, for the tests that kill or stop it.

Registers a poisoned pool of the tests' layout with ``--kv-backend nixl``, prints its
descriptor (hex), then idles until stdin closes (or 120 s, so a forgotten child never lingers).
Run: ``python -m tests.kvtransfer.receiver_child``.
"""
from __future__ import annotations

import sys
import threading

import torch

from kvtransfer import KVLayout, create_receiver
from tests.kvtransfer.conftest import DST_BLOCKS, POISON


def main() -> None:
    layout = KVLayout("bfloat16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    pool = torch.empty(layout.pool_shape(DST_BLOCKS), dtype=layout.torch_dtype)
    pool.view(torch.uint8).fill_(POISON)
    receiver = create_receiver(pool, layout, "nixl", lease_s=60.0)
    print(receiver.descriptor.to_bytes().hex(), flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait(timeout=120)
    receiver.close()


if __name__ == "__main__":
    main()
