"""A sender in its own process, for the kill -9 contract test.

Reads a descriptor (hex) from stdin, connects and prints ``ready``; on a ``go`` line writes
``--layers`` of one request from a pool made from ``--seed``, prints ``written``, then idles
(its worker keeps heartbeating) until killed.
Run: ``python -m tests.kvtransfer.sender_child BACKEND REQUEST_ID --layers 0 1 --src 0 1
--dst 5 6``.
"""
from __future__ import annotations

import argparse
import sys
import time

from kvtransfer import KVLayout, create_sender
from tests.kvtransfer.conftest import SRC_BLOCKS, random_pool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend")
    parser.add_argument("request_id")
    parser.add_argument("--layers", type=int, nargs="+", required=True)
    parser.add_argument("--src", type=int, nargs="+", required=True)
    parser.add_argument("--dst", type=int, nargs="+", required=True)
    parser.add_argument("--seed", type=int, default=99)
    parser.add_argument("--heartbeat-s", type=float, default=0.1)
    args = parser.parse_args()
    layout = KVLayout("bfloat16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    device = "cuda" if args.backend == "cuda-ipc" else "cpu"
    src = random_pool(layout, SRC_BLOCKS, args.seed, device)
    sender = create_sender(bytes.fromhex(sys.stdin.readline().strip()), src, layout,
                           args.backend, heartbeat_s=args.heartbeat_s)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    for layer in args.layers:
        sender.write(args.request_id, [layer], args.src, args.dst)
    sender.flush(timeout_s=10)
    print("written", flush=True)
    deadline = time.monotonic() + 120  # never outlive a test run that forgot us
    while time.monotonic() < deadline:
        time.sleep(0.5)


if __name__ == "__main__":
    main()
