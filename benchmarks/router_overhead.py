"""Router overhead: added latency per request and sustained streamed requests/s.

    python benchmarks/router_overhead.py [--tokens 8] [--pace-ms 1] [--requests 3000] [--concurrency 64]
                                         [--local-prefill] [--per-call | --forwarder]

Three processes, like a deployment on one host: fake workers (tests/router/fake_workers.py: real gRPC
servers making one token per --pace-ms for every open request, no model), the router
(`python -m router`), and this load generator. The load generator is the async SDK
(tandem_client/), which sends every request on its one Multiplex stream; --per-call makes it
use one Generate call per request instead, as a client of the plain RPCs does (grpcurl, another
language's stubs). Added latency = a request's end-to-end time
through the router (SDK -> router -> workers) minus the same request sent straight to the fake
workers the way the router sends it (started on D's Session stream, submitted on P's:
router/session.py), both at concurrency 1. Throughput = streamed requests
completed per second through the router at --concurrency; the CPU time each process spent
per request in that phase is printed beside it (read from /proc on Linux): on a shared machine
requests/s follows what else runs there far more than the router's CPU per request does. All
three processes run on uvloop where it is installed, as the router does.

--forwarder puts a bare grpc.aio forwarder in the router's place (Generate -> a start on D's
session + a submit on P's, messages copied through; no validation, tokenizer, policy, metrics or
failover): the floor of a router with this transport on this machine, to read the router's
numbers against (it has Generate only, so the SDK makes a call per request).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protos.grpc_io import describe, use_polling_io  # noqa: E402

use_polling_io()   # as the router and workers do (protos/grpc_io.py); before grpc is imported

import grpc  # noqa: E402

from protos.auth import SECRET_ENV, new_secret  # noqa: E402
from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
from router.session import DecodeSession, PrefillSession  # noqa: E402
from tandem_client import AsyncTandemClient  # noqa: E402


async def serve_fakes(pace_s: float) -> None:
    from tests.router.fake_workers import FakeWorker
    prefill = await FakeWorker("prefill").start()
    decode = await FakeWorker("decode", token_interval_s=pace_s).start()
    print(json.dumps({"prefill": prefill.address, "decode": decode.address}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await prefill.stop()
    await decode.stop()


class Forwarder(tandem_pb2_grpc.TandemServicer):
    """The least a router does per request: a start on D's session, a submit on P's, copy the stream."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.addresses = {"prefill": prefill, "decode": decode}
        self.decode = DecodeSession(worker_pb2_grpc.DecodeWorkerStub(grpc.aio.insecure_channel(decode)), decode)
        self.prefill = PrefillSession(worker_pb2_grpc.PrefillWorkerStub(grpc.aio.insecure_channel(prefill)), prefill)
        self.num_requests = 0

    async def Generate(self, request, context):
        self.num_requests += 1
        rid, prompt = f"fwd-{self.num_requests}", list(request.prompt_token_ids)
        sampling = worker_pb2.SamplingParams(max_tokens=request.sampling.max_tokens)
        call = self.decode.generate(worker_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling, prefill_address=self.addresses["prefill"]))
        submit = asyncio.ensure_future(self.prefill.submit(worker_pb2.SubmitRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling, decode_address=self.addresses["decode"]), 30))
        async for response in call:
            chunk = tandem_pb2.CompletionChunk(request_id=rid, token_ids=response.token_ids)
            if response.finish_reason:
                chunk.finish_reason = response.finish_reason
                chunk.usage.completion_tokens = response.num_output_tokens
                yield chunk
                break
            yield chunk
        await submit


async def serve_forwarder(prefill: str, decode: str) -> None:
    server = grpc.aio.server()
    tandem_pb2_grpc.add_TandemServicer_to_server(Forwarder(prefill, decode), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print("TANDEM_ROUTER_READY " + json.dumps({"http": None, "grpc": f"127.0.0.1:{port}"}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await server.stop(None)


def run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def read_line(proc: subprocess.Popen, prefix: str = "") -> str:
    while True:
        line = proc.stdout.readline().decode()
        if not line:
            raise RuntimeError(f"process exited: rc={proc.poll()}")
        if line.startswith(prefix):
            return line[len(prefix):]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux; 0.0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def direct_once(decode: DecodeSession, prefill: PrefillSession | None, addresses, rid: str,
                      prompt: list[int], tokens: int) -> float:
    """One request straight to the workers; ``prefill=None``: the decode worker prefills it."""
    sampling = worker_pb2.SamplingParams(temperature=0.0, max_tokens=tokens)
    start = time.perf_counter()
    submit = None
    if prefill is None:
        call = decode.generate(worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                                          local_prefill=True))
    else:
        call = decode.generate(worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                                          sampling=sampling, prefill_address=addresses["prefill"]))
        submit = asyncio.ensure_future(prefill.submit(worker_pb2.SubmitRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling, decode_address=addresses["decode"]), 30))
    async for _ in call:
        pass
    if submit is not None:
        await submit
    return time.perf_counter() - start


async def routed_once(client: AsyncTandemClient, prompt: list[int], tokens: int) -> float:
    start = time.perf_counter()
    received = 0
    async for chunk in client.generate_stream(prompt, max_tokens=tokens, temperature=0.0):
        received += len(chunk.token_ids)
    elapsed = time.perf_counter() - start
    if received != tokens:
        raise RuntimeError(f"a request through the router streamed {received} tokens, not {tokens}")
    return elapsed


async def measure(args, addresses: dict, router_grpc: str, pids: dict[str, int]) -> None:
    prompt = list(range(1000, 1016))
    channels = {role: grpc.aio.insecure_channel(addr) for role, addr in addresses.items()}
    decode = DecodeSession(worker_pb2_grpc.DecodeWorkerStub(channels["decode"]), addresses["decode"])
    prefill = PrefillSession(worker_pb2_grpc.PrefillWorkerStub(channels["prefill"]), addresses["prefill"])
    direct_prefill = None if args.local_prefill else prefill
    async with AsyncTandemClient(router_grpc, multiplex=not (args.per_call or args.forwarder)) as client:
        for i in range(50):  # warm up both paths
            await direct_once(decode, direct_prefill, addresses, f"warm-{i}", prompt, args.tokens)
            await routed_once(client, prompt, args.tokens)
        direct, routed = [], []
        router_cpu_s = 0.0
        for i in range(args.latency_requests):
            direct.append(await direct_once(decode, direct_prefill, addresses, f"d-{i}", prompt, args.tokens))
            before = cpu_s(pids["router"])
            routed.append(await routed_once(client, prompt, args.tokens))
            router_cpu_s += cpu_s(pids["router"]) - before
        ms = 1000.0
        print(f"latency, concurrency 1, {args.tokens} tokens at {args.pace_ms} ms/token, "
              f"{args.latency_requests} requests, {'local prefill on D' if args.local_prefill else 'P/D'}, "
              f"SDK {'one Generate call per request' if args.per_call or args.forwarder else 'Multiplex stream'}:")
        print(f"  direct to workers  p50 {pct(direct, .5) * ms:7.3f} ms  p99 {pct(direct, .99) * ms:7.3f} ms")
        print(f"  through router     p50 {pct(routed, .5) * ms:7.3f} ms  p99 {pct(routed, .99) * ms:7.3f} ms")
        print(f"  added by router    p50 {(pct(routed, .5) - pct(direct, .5)) * ms:7.3f} ms  "
              f"p99 {(pct(routed, .99) - pct(direct, .99)) * ms:7.3f} ms  "
              f"(mean {(statistics.mean(routed) - statistics.mean(direct)) * ms:.3f} ms)")
        print(f"  router CPU per request at concurrency 1: {router_cpu_s * ms / args.latency_requests:.3f} ms")

        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(args.requests):
            queue.put_nowait(i)

        async def worker() -> int:
            done = 0
            while not queue.empty():
                queue.get_nowait()
                await routed_once(client, prompt, args.tokens)
                done += 1
            return done
        cpu_before = {name: cpu_s(pid) for name, pid in pids.items()}
        start = time.perf_counter()
        done = sum(await asyncio.gather(*(worker() for _ in range(args.concurrency))))
        elapsed = time.perf_counter() - start
        cpu_ms = {name: (cpu_s(pid) - cpu_before[name]) * ms / done for name, pid in pids.items()}
        print(f"throughput, concurrency {args.concurrency}: {done} streamed requests ({args.tokens} tokens each) in "
              f"{elapsed:.2f} s = {done / elapsed:.0f} requests/s, {done * args.tokens / elapsed:.0f} tokens/s")
        print("  CPU per request    " + "  ".join(f"{name} {v:.3f} ms" for name, v in cpu_ms.items())
              + (f"  (router alone on one core: {ms / cpu_ms['router']:.0f} requests/s)" if cpu_ms["router"] else ""))
    await decode.close()
    await prefill.close()
    for channel in channels.values():
        await channel.close()


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--pace-ms", type=float, default=1.0)
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--local-prefill", action="store_true",
                        help="the router runs with --local-prefill-max-tokens 4096 (tandem serve's default on one CPU "
                             "node): requests go to the decode worker alone")
    parser.add_argument("--per-call", action="store_true",
                        help="the SDK makes one Generate call per request (AsyncTandemClient(multiplex=False)) "
                             "instead of sending all of them on its Multiplex stream")
    parser.add_argument("--forwarder", action="store_true",
                        help="measure a bare grpc.aio forwarder in the router's place (the transport's floor)")
    parser.add_argument("--serve-fakes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-forwarder", nargs=2, metavar=("PREFILL", "DECODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fakes:
        run(serve_fakes(args.pace_ms / 1000.0))
        return 0
    if args.serve_forwarder:
        run(serve_forwarder(*args.serve_forwarder))
        return 0
    # The router needs a cluster secret; the fake workers check none.
    env = {SECRET_ENV: new_secret(), **os.environ, "PYTHONPATH": str(ROOT)}
    fakes = subprocess.Popen([sys.executable, __file__, "--serve-fakes", "--pace-ms", str(args.pace_ms)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env)
    router = None
    try:
        addresses = json.loads(read_line(fakes))
        if args.forwarder and args.local_prefill:
            parser.error("--forwarder always sends to both workers; leave out --local-prefill")
        if args.forwarder:
            argv = [__file__, "--serve-forwarder", addresses["prefill"], addresses["decode"]]
        else:
            argv = ["-m", "router", "--http-port", "-1", "--grpc-port", "0", "--prefill", addresses["prefill"],
                    "--decode", addresses["decode"], "--max-waiting", "100000", "--log-level", "WARNING",
                    "--local-prefill-max-tokens", "4096" if args.local_prefill else "0"]
        router = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT,
                                  env=env)
        ready = json.loads(read_line(router, "TANDEM_ROUTER_READY "))
        time.sleep(1.5)  # first heartbeat marks the workers healthy
        print(f"machine: {os.cpu_count()} CPUs, load average {_load()}; fake workers, "
              f"{'a bare forwarder' if args.forwarder else 'router'} and this client are separate processes; "
              f"grpc {describe()}")
        run(measure(args, addresses, ready["grpc"], {"router": router.pid, "fakes": fakes.pid, "client": os.getpid()}))
        print(f"load average after: {_load()}")
    finally:
        for proc in (router, fakes):
            if proc is not None:
                proc.stdin.close()
                proc.terminate()
                proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
