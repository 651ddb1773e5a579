"""One grpc.aio hop on this machine: a streamed message's round trip and CPU, per I/O path.

    python benchmarks/grpc_hop.py [--messages 3000]

Two processes, an echo server and a client, on one long bidirectional stream (as the router's
sessions and the SDK's Multiplex are): the client writes a 40-byte message and waits for it to
come back, --messages times, then reports the round trip's p50/p90 and each side's CPU per
round trip. Run once with grpc's default I/O path (``GRPC_EXPERIMENTS=""``) and once with the
poller-thread path Tandem's processes use (protos/grpc_io.py), one after the other; both on
uvloop where it is installed, as the router runs. This is the floor of every hop between the
SDK, the router and the workers; benchmarks/router_overhead.py measures the router on top.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
METHOD = "/tandem.bench.Echo/Stream"

# grpc reads GRPC_EXPERIMENTS when it is imported: main() sets it in each child's environment,
# so importing these helpers (which import grpc) here is safe.
from benchmarks.router_overhead import cpu_s, run  # noqa: E402
from protos.grpc_io import EXPERIMENTS  # noqa: E402


async def serve() -> None:
    import grpc

    async def echo(requests, context):
        async for message in requests:
            yield message
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "tandem.bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)   # until the parent closes stdin
    await server.stop(None)


async def ping(port: int, n: int, warmup: int) -> list[float]:
    import grpc
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(METHOD)()
        times = []
        for _ in range(warmup + n):
            start = time.perf_counter()
            await call.write(b"x" * 40)
            await call.read()
            times.append(time.perf_counter() - start)
        await call.done_writing()
    return times[warmup:]


def client(n: int) -> None:
    """Runs with GRPC_EXPERIMENTS already set in its environment (grpc reads it at import)."""
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        port = int(server.stdout.readline())
        ping_cpu, serve_cpu = time.process_time(), cpu_s(server.pid)
        times = run(ping(port, n, warmup=200))
        ping_cpu, serve_cpu = time.process_time() - ping_cpu, cpu_s(server.pid) - serve_cpu
    finally:
        server.stdin.close()
        server.wait(10)
    ms = 1000.0
    ordered = sorted(times)
    print(f"  GRPC_EXPERIMENTS={os.environ.get('GRPC_EXPERIMENTS', '')!r:48} round trip p50 "
          f"{statistics.median(times) * ms:.3f} ms  p90 {ordered[int(0.9 * len(ordered))] * ms:.3f} ms  "
          f"CPU per round trip: client {ping_cpu * ms / n:.3f} ms, server {serve_cpu * ms / (n + 200):.3f} ms",
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        run(serve())
        return 0
    if args.client:
        client(args.messages)
        return 0
    print(f"machine: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{args.messages} round trips of a 40-byte message on one stream, echo server in its own process")
    for experiments in ("", EXPERIMENTS):
        env = {**os.environ, "GRPC_EXPERIMENTS": experiments}
        subprocess.run([sys.executable, __file__, "--client", "--messages", str(args.messages)], env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
