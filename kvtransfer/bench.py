"""kvtransfer benchmark: bandwidth and latency of each backend against its baseline (CLI).

``python -m kvtransfer.bench --json`` moves a SmolLM2-shaped request (30 layers, 3 KV heads,
head_dim 64, bfloat16, block_size 16) of 1k and 8k tokens and prints, as its last line, one
JSON object: ``memcpy_gbps`` (in-process copy of the same bytes), ``shm_gbps``, ``tcp_gbps``,
``zmq_raw_gbps`` (plain ZeroMQ PUSH/PULL of the same frames between two processes), ``nixl_gbps``
when NIXL is installed (over the transports UCX picks: shared memory on one host unless
``UCX_TLS=tcp,self`` says TCP) and ``request_latency_ms`` for a 1k-token request per backend.
Senders run in a child process (``--child``) driven by lines on its stdin; the parent times from the "go" line until the
receiver reports the request done (or the last raw frame arrived). GB/s are 1e9 bytes/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
import zmq

from . import FakeFabric, KVLayout, NotifyPayload, create_receiver, create_sender
from .region import create_shm_pool, remove_shm_pool

LAYOUT = KVLayout("bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
TOKENS = (1024, 8192)
PAYLOAD = NotifyPayload(first_token_id=42, first_logprob=-0.25)


def _blocks(num_tokens: int) -> int:
    return -(-num_tokens // LAYOUT.block_size)


def _request_nbytes(num_tokens: int) -> int:
    return LAYOUT.pool_nbytes(_blocks(num_tokens))   # every layer's K and V of its blocks


def _iters(num_tokens: int, base: int) -> int:
    return max(3, base * 1024 // num_tokens) if num_tokens > 1024 else base


class _Memcpy:
    """In-process copy of one request's bytes: one contiguous memcpy (numpy)."""

    def __init__(self, max_tokens: int) -> None:
        nbytes = _request_nbytes(max_tokens)
        self._src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
        self._dst = np.ones(nbytes, dtype=np.uint8)  # ones: pages faulted in

    def once(self, num_tokens: int, i: int) -> float:
        n = _request_nbytes(num_tokens)
        t0 = time.perf_counter()
        np.copyto(self._dst[:n], self._src[:n])
        return time.perf_counter() - t0

    def close(self) -> None:
        pass


class _Child:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtransfer.bench", "--child", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout

    def send(self, line: str) -> None:
        self._stdin.write(line + "\n")
        self._stdin.flush()

    def expect(self, word: str) -> None:
        line = self._stdout.readline().strip()
        if line != word:
            raise RuntimeError(f"bench child said {line!r}, expected {word!r}")

    def close(self) -> None:
        self.send("quit")
        self.proc.wait(timeout=30)


class _Backend:
    """A receiver here, its sender in a child process; one request = all layers + notify."""

    def __init__(self, backend: str, max_tokens: int) -> None:
        self.name = backend
        self._pool, self._path = create_shm_pool(LAYOUT, _blocks(max_tokens))
        self._pool.view(torch.uint8).fill_(1)  # fault the pages in before timing
        self._receiver = create_receiver(self._pool, LAYOUT, backend, shm_path=self._path,
                                         lease_s=60.0)
        self._child = _Child("sender", backend, str(_blocks(max_tokens)))
        self._child.send(self._receiver.descriptor.to_bytes().hex())
        self._child.expect("ready")

    def once(self, num_tokens: int, i: int) -> float:
        n = _blocks(num_tokens)
        request_id = f"{self.name}-{num_tokens}-{i}"
        self._receiver.expect(request_id, range(n), lease_s=60.0)
        t0 = time.perf_counter()
        self._child.send(f"go {request_id} {n}")
        result = self._receiver.wait(request_id, timeout_s=60)
        elapsed = time.perf_counter() - t0
        if result.status.value != "done":
            raise RuntimeError(f"request_id={request_id}: {result}")
        self._receiver.release(request_id)
        return elapsed

    def close(self) -> None:
        self._child.close()
        self._receiver.close()
        remove_shm_pool(self._path)


class _ZmqRaw:
    """Plain PUSH/PULL of the same frames the tcp backend sends: per layer, K and V."""

    def __init__(self, max_tokens: int) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._child = _Child("zmq-raw", f"tcp://127.0.0.1:{port}", str(_request_nbytes(max_tokens)))
        self._child.expect("ready")

    def once(self, num_tokens: int, i: int) -> float:
        frame_nbytes = _blocks(num_tokens) * LAYOUT.block_nbytes
        t0 = time.perf_counter()
        self._child.send(f"go {frame_nbytes}")
        got = 0
        for _ in range(LAYOUT.num_layers):
            got += sum(len(f.buffer) for f in self._sock.recv_multipart(copy=False))
        elapsed = time.perf_counter() - t0
        if got != _request_nbytes(num_tokens):
            raise RuntimeError("zmq raw: short transfer")
        return elapsed

    def close(self) -> None:
        self._child.close()
        self._sock.close(linger=0)
        self._ctx.term()


def bench_side_by_side(tokens: list[int], base_iters: int) -> dict[str, dict[int, list[float]]]:
    """Interleave the four measurements per iteration so machine load hits them alike."""
    max_tokens = max(tokens)
    runners: dict = {"memcpy": _Memcpy(max_tokens)}
    try:
        runners["shm"] = _Backend("shm", max_tokens)
        runners["zmq_raw"] = _ZmqRaw(max_tokens)
        runners["tcp"] = _Backend("tcp", max_tokens)
        if _has_nixl():
            runners["nixl"] = _Backend("nixl", max_tokens)
        times: dict[str, dict[int, list[float]]] = {k: {} for k in runners}
        for num_tokens in tokens:
            for i in range(_iters(num_tokens, base_iters) + 2):
                for name, runner in runners.items():
                    elapsed = runner.once(num_tokens, i)
                    if i >= 2:  # the first two warm page tables and sockets
                        times[name].setdefault(num_tokens, []).append(elapsed)
        return times
    finally:
        for runner in runners.values():
            runner.close()


def _has_nixl() -> bool:
    try:
        from .nixl import bindings
        bindings()
    except ImportError:
        return False
    return True


def bench_fake_latency(num_tokens: int, iters: int) -> list[float]:
    n = _blocks(num_tokens)
    fabric = FakeFabric()
    dst = torch.zeros(LAYOUT.pool_shape(n), dtype=LAYOUT.torch_dtype)
    src = torch.ones(LAYOUT.pool_shape(n), dtype=LAYOUT.torch_dtype)
    receiver = create_receiver(dst, LAYOUT, "fake", fabric=fabric)
    sender = create_sender(receiver.descriptor, src, LAYOUT, "fake", fabric=fabric)
    times = []
    for i in range(iters + 2):
        request_id = f"fake-{i}"
        receiver.expect(request_id, range(n))
        t0 = time.perf_counter()
        sender.write(request_id, range(LAYOUT.num_layers), range(n), range(n))
        sender.notify(request_id, PAYLOAD)
        receiver.wait(request_id, timeout_s=10)
        if i >= 2:
            times.append(time.perf_counter() - t0)
        receiver.release(request_id)
    sender.close()
    receiver.close()
    return times


def run_child(argv: list[str]) -> None:
    kind = argv[0]
    if kind == "sender":
        num_blocks = int(argv[2])
        descriptor = bytes.fromhex(sys.stdin.readline().strip())
        src = torch.randint(-100, 100, LAYOUT.pool_shape(num_blocks)).to(LAYOUT.torch_dtype)
        sender = create_sender(descriptor, src, LAYOUT, argv[1])
        print("ready", flush=True)
        for line in sys.stdin:
            words = line.split()
            if words[0] == "quit":
                break
            request_id, n = words[1], int(words[2])
            sender.write(request_id, range(LAYOUT.num_layers), range(n), range(n))
            sender.notify(request_id, PAYLOAD)
        sender.flush(timeout_s=30)
        sender.close()
        return
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(argv[1])
    buf = torch.randint(0, 256, (int(argv[2]),), dtype=torch.uint8).numpy()
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "quit":
            break
        frame_nbytes = int(words[1])
        for layer in range(LAYOUT.num_layers):
            off = 2 * layer * frame_nbytes
            frames: list[Any] = [buf[off:off + frame_nbytes], buf[off + frame_nbytes:off + 2 * frame_nbytes]]
            sock.send_multipart(frames, copy=False)
    sock.close(linger=0)
    ctx.term()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvtransfer.bench", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--iters", type=int, default=20, help="timed 1k-token requests per backend")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS),
                        help="request sizes in tokens; the first is used for request_latency_ms")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args.child)
        return
    lat = {}
    med = statistics.median
    tokens = args.tokens
    gbps = bench_side_by_side(tokens, args.iters)
    lat["fake"] = med(bench_fake_latency(tokens[0], args.iters)) * 1e3
    result: dict[str, Any] = {
        "layout": {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "bfloat16",
                   "block_size": 16},
        "request_bytes": {str(t): _request_nbytes(t) for t in tokens},
        "latency_tokens": tokens[0],
        "torch_threads": torch.get_num_threads(),
    }
    for name, by_tokens in gbps.items():
        result[f"{name}_gbps"] = {str(t): round(_request_nbytes(t) / med(ts) / 1e9, 3)
                                  for t, ts in by_tokens.items()}
        if name in ("shm", "tcp", "nixl"):
            lat[name] = med(by_tokens[tokens[0]]) * 1e3
    result["request_latency_ms"] = {k: round(v, 3) for k, v in lat.items()}
    result["ratio_shm_vs_memcpy"] = {t: round(result["shm_gbps"][t] / result["memcpy_gbps"][t], 3)
                                     for t in result["shm_gbps"]}
    result["ratio_tcp_vs_zmq_raw"] = {t: round(result["tcp_gbps"][t] / result["zmq_raw_gbps"][t], 3)
                                      for t in result["tcp_gbps"]}
    if not args.json:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
        return
    print(json.dumps(result))


if __name__ == "__main__":
    main()
