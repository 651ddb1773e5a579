"""KV transfer between two nodes over a capped link, and how much of it layer-wise overlap hides (a script, not a test).

    sudo .venv/bin/python benchmarks/cluster_kv.py [--prompt-tokens 1024,4096] [--rates 0,10000,1000] [--repeats 3]
                                                   [--kv-backends tcp,nixl]

Ctrl-C, SIGTERM or an error stop the services and remove the namespaces; after a SIGKILL the next
run removes what is left (NetnsCluster's remove_stale). Traffic stays on the nodes' bridge.

Setup (docs/architecture.md#processes): two Linux network namespaces made by
tests/cluster/netns.py (root needed), each a "node" with its own address, hostname and
/dev/shm, so the KV crosses the link between them: with ``--kv-backend tcp`` (ZeroMQ, CurveZMQ
under the cluster secret; what ``auto`` picks between nodes) or ``nixl`` (NIXL one-sided writes
over UCX, here its TCP transport: the only one between namespaces; unencrypted), each backend of
``--kv-backends`` in turn with fresh services. Node A runs the prefill worker and the router, node B the decode worker,
the three with one fresh cluster secret in their environment; the workers bind their node's
address and are registered with the router by Admin.RegisterWorker, as deploy/controller.py
does. The router runs with --local-prefill-max-tokens 0, so every prompt goes P -> D. The
model is the real embedded SmolLM2-135M, one torch thread per worker (--num-threads; the
machine's cores serve both nodes). The link is uncapped (a veth pair: as fast as the CPUs move
the bytes) or capped in Mbit/s by tc tbf on both nodes' links (``NetnsCluster.cap``).

For each link rate, prompt length and repeat, this process (root namespace, on the nodes'
bridge) streams two requests through the router's gRPC API (tandem_client/), one at a time:

1. a fresh prompt (random token ids: no prefix-cache hit). TTFT = send -> first streamed token,
   as the client sees it;
2. the same prompt again. The prefill worker finds all but its last block in its prefix cache,
   computes those few tokens and ships the whole KV at once, with next to no compute to hide
   it behind: its TTFT is the *whole transfer* as the product does it, plus the same hops
   (router, decode worker's poll, stream back) as request 1 and a few tokens' compute -- an
   upper bound, by some ms. (The prefill worker's own time for it is no help: the transfer's
   threads slow that short forward down on the shared cores, and it overlaps the transfer.)

Around each request it reads both workers' /metrics (worker/metrics.py):
- prefill: the prefill worker's own tandem_time_to_first_token_seconds (its Submit arrived ->
  first token sampled). Writes are asynchronous, so this is compute, plus issuing the per-layer
  writes and whatever the transfer's threads take from the engine thread on the shared cores;
- KV: tcp: the decode worker's tandem_kv_received_bytes_total, bytes that came over the network
  as the tcp backend's payload, once it reached what the prefill worker counts as shipped; nixl:
  what the prefill worker counts as shipped (tandem_kv_transfer_bytes_total), once the decode
  worker counted the transfer. Either way node B's link must have carried at least that many
  bytes in (its veth's byte counter), or the run stops: the KV crossed the link;
- D xfer: the decode worker's tandem_kv_transfer_seconds, the product's own transfer time. It
  runs from blocks reserved to every layer and the notify landed, so it contains the prefill.

Derived, per repeat and then the median over repeats:
- whole xfer = request 2's TTFT; xfer Gbit/s = KV / whole xfer; KV/rate = the ideal at the cap;
- no-overlap bound = prefill + whole xfer: TTFT if the KV left only after the prefill;
- 1-layer bound = prefill + whole xfer / num_layers: the overlap claim, TTFT close to this;
- hidden = 1 - (TTFT - prefill) / whole xfer: the share of the transfer kept off TTFT.

The prefill worker writes each layer's KV right after that layer runs, in every chunk's forward
once the decode worker's destination is known (prefill_worker/worker.py, ``_layer_plan``);
a prompt of one chunk (--chunked-prefill-size: 512 on CPU) starts computing on its Submit,
before the destination comes, and its KV is written after the forward (``_ship``): no overlap
(try --prompt-tokens 512). The cores the workers share also run the transfer's encryption and
copies on both nodes. Each KV pool holds two of the longest requests, and an uncounted warm-up
allocates each of its blocks once, so no point pays the pools' first-touch page faults.
Requests run one at a time; the load average is printed, as other work on the machine shows
up as noise.
"""
from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# `engine` package: put the repository root there instead.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO_ROOT)

import grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from deploy.launch import ServiceProcess  # noqa: E402
from engine.model_source import load_arch, resolve_model  # noqa: E402
from protos.auth import SECRET_ENV, SecretStub, new_secret  # noqa: E402
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc  # noqa: E402
from router.config import READY_PREFIX as ROUTER_READY_PREFIX  # noqa: E402
from tandem_client import TandemClient  # noqa: E402
from tests.cluster.netns import NetnsCluster, Node, missing_requirements  # noqa: E402
from worker.process import READY_PREFIX as WORKER_READY_PREFIX  # noqa: E402

KV_BACKENDS = ("tcp", "nixl")

CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")
BLOCK_SIZE = 16   # the workers' --block-size default: a repeated prompt hits all but its last block
WARMUP_PAIRS = 2  # per prompt length: allocate every block of both pools once (first-touch page faults)
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")


@dataclass(frozen=True)
class Sample:
    """One request, as the client and the workers' /metrics saw it."""

    ttft_s: float
    prefill_s: float
    kv_bytes: float
    decode_xfer_s: float
    cached_tokens: int


@dataclass(frozen=True)
class Services:
    prefill: ServiceProcess
    decode: ServiceProcess
    router: ServiceProcess

    def all(self) -> tuple[ServiceProcess, ...]:
        return self.prefill, self.decode, self.router


# -- the cluster ---------------------------------------------------------------------------------
def worker_argv(cluster: NetnsCluster, node: Node, role: str, args: argparse.Namespace, backend: str) -> list[str]:
    """Its node's address, ports picked; a KV pool of two longest requests (see WARMUP_PAIRS)."""
    max_model_len = max(args.prompt_tokens) + args.max_tokens
    num_blocks = 2 * -(-max_model_len // BLOCK_SIZE)
    flags = ["--model", args.model, "--host", node.ip, "--port", "0", "--num-threads", str(args.num_threads),
             "--max-model-len", str(max_model_len), "--num-gpu-blocks-override", str(num_blocks),
             "--chunked-prefill-size", str(args.chunked_prefill_size), "--kv-backend", backend]
    return cluster.exec_argv(node, [sys.executable, "-m", f"{role}_worker", *flags])


def router_argv(cluster: NetnsCluster, node: Node, args: argparse.Namespace) -> list[str]:
    return cluster.exec_argv(node, [sys.executable, "-m", "router", "--model", args.model, "--host", node.ip,
                                    "--grpc-port", "0", "--http-port", "-1", "--local-prefill-max-tokens", "0",
                                    "--log-level", "WARNING"])


def start_services(cluster: NetnsCluster, args: argparse.Namespace, log_dir: Path, backend: str) -> Services:
    """Prefill worker and router in node A, decode worker in node B, all loading at once; each
    killed with this process (die_with_parent), stderr in ``log_dir/<name>.log``."""
    node_a, node_b = cluster.nodes

    def start(name: str, argv: list[str], ready_prefix: str) -> ServiceProcess:
        log = open(log_dir / f"{name}-{backend}.log", "wb")  # noqa: SIM115 - the child writes it until it exits
        return ServiceProcess(name, argv, ready_prefix, stderr=log, die_with_parent=True)

    return Services(prefill=start("prefill", worker_argv(cluster, node_a, "prefill", args, backend),
                                  WORKER_READY_PREFIX),
                    decode=start("decode", worker_argv(cluster, node_b, "decode", args, backend), WORKER_READY_PREFIX),
                    router=start("router", router_argv(cluster, node_a, args), ROUTER_READY_PREFIX))


def stop(cluster: NetnsCluster, service: ServiceProcess, timeout_s: float = 10.0) -> None:
    """SIGTERM to the service in its node (NetnsCluster.terminate), then ServiceProcess.stop."""
    cluster.terminate(service.proc, timeout_s)
    service.stop()


def register_workers(router_grpc: str, services: Services, secret: str) -> None:
    """Admin.RegisterWorker for both workers, with the cluster secret (deploy/controller.py)."""
    with grpc.insecure_channel(router_grpc) as channel:
        admin = SecretStub(admin_pb2_grpc.AdminStub(channel), secret)
        for role, service in (("prefill", services.prefill), ("decode", services.decode)):
            admin.RegisterWorker(admin_pb2.RegisterWorkerRequest(role=role, address=service.info["grpc"]),
                                 timeout=10.0, wait_for_ready=True)


def wait_healthy(client: TandemClient, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sorted(w.role for w in client.cluster() if w.healthy) != ["decode", "prefill"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not healthy at the router after {timeout_s:.0f} s: {client.cluster()}")
        time.sleep(0.2)


def set_rate(cluster: NetnsCluster, mbit: int) -> None:
    """Cap both nodes' links at ``mbit`` Mbit/s (tc tbf, both directions); 0 = uncapped."""
    for node in cluster.nodes:
        cluster.uncap(node)
        if mbit:
            cluster.cap(node, mbit)


# -- one request ---------------------------------------------------------------------------------
def scrape(address: str) -> dict[str, float]:
    """A worker's /metrics as {sample name: value} (one role per worker, so labels are dropped)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for_metric(address: str, name: str, at_least: float, timeout_s: float = 30.0) -> dict[str, float]:
    """A worker's /metrics once ``name`` reached ``at_least``: a worker counts a transfer when its
    engine thread next looks, which may be after the client's first token."""
    deadline = time.monotonic() + timeout_s
    while (metrics := scrape(address))[name] < at_least:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} at {address} is {metrics[name]:.0f} after {timeout_s:.0f} s, "
                               f"not {at_least:.0f}")
        time.sleep(0.02)
    return metrics


def link_rx_bytes(node: Node) -> int:
    """Bytes ``node`` has received on its link: what the bridge's end of its veth pair sent."""
    return int(Path(f"/sys/class/net/{node.host_veth}/statistics/tx_bytes").read_text())


def timed_request(client: TandemClient, metrics: dict[str, str], prompt: list[int], max_tokens: int,
                  backend: str, decode_node: Node) -> Sample:
    """Stream one request through the router; TTFT from the client, the rest from /metrics deltas."""
    before = {role: scrape(address) for role, address in metrics.items()}
    rx_before = link_rx_bytes(decode_node)
    start = time.perf_counter()
    ttft_s, usage = None, None
    for chunk in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        if ttft_s is None and chunk.token_ids:
            ttft_s = time.perf_counter() - start
        usage = chunk.usage or usage
    if ttft_s is None or usage is None:
        raise RuntimeError("the request streamed no token")

    def delta(after: dict[str, float], role: str, name: str) -> float:
        return after[name] - before[role][name]

    p = wait_for_metric(metrics["prefill"], "tandem_kv_transfer_seconds_count",
                        before["prefill"]["tandem_kv_transfer_seconds_count"] + 1)
    shipped = delta(p, "prefill", "tandem_kv_transfer_bytes_total")
    if backend == "tcp":   # received as tcp payload: all of it, or the KV did not take the tcp backend
        d = wait_for_metric(metrics["decode"], "tandem_kv_received_bytes_total",
                            before["decode"]["tandem_kv_received_bytes_total"] + shipped)
        kv_bytes = delta(d, "decode", "tandem_kv_received_bytes_total")
    else:                  # NIXL writes land in the pool without passing the receiver's socket
        d = wait_for_metric(metrics["decode"], "tandem_kv_transfer_seconds_count",
                            before["decode"]["tandem_kv_transfer_seconds_count"] + 1)
        kv_bytes = shipped
    crossed = link_rx_bytes(decode_node) - rx_before
    if crossed < kv_bytes:
        raise RuntimeError(f"{backend}: the decode node's link took {crossed} bytes in for {kv_bytes:.0f} bytes of KV")
    return Sample(ttft_s=ttft_s, prefill_s=delta(p, "prefill", "tandem_time_to_first_token_seconds_sum"),
                  kv_bytes=kv_bytes,
                  decode_xfer_s=delta(d, "decode", "tandem_kv_transfer_seconds_sum"),
                  cached_tokens=usage.cached_tokens)


def measure_point(client: TandemClient, metrics: dict[str, str], rng: random.Random, num_tokens: int,
                  repeats: int, max_tokens: int, backend: str, decode_node: Node) -> list[tuple[Sample, Sample]]:
    """``repeats`` x (a fresh prompt, then the same prompt again: the whole-transfer probe)."""
    pairs = []
    for _ in range(repeats):
        prompt = [rng.randrange(100, 40000) for _ in range(num_tokens)]
        fresh = timed_request(client, metrics, prompt, max_tokens, backend, decode_node)
        again = timed_request(client, metrics, prompt, max_tokens, backend, decode_node)
        if fresh.cached_tokens or again.cached_tokens < num_tokens - BLOCK_SIZE:
            raise RuntimeError(f"prefix cache not as planned: {fresh.cached_tokens} cached tokens on the fresh "
                               f"prompt, {again.cached_tokens} of {num_tokens} on its repeat")
        pairs.append((fresh, again))
    return pairs


# -- the report ----------------------------------------------------------------------------------
def summarize(pairs: list[tuple[Sample, Sample]], mbit: int, num_layers: int) -> dict[str, float]:
    """Medians over repeats of what the module docstring lists (seconds, bytes)."""
    def med(f) -> float:
        return statistics.median(f(fresh, again) for fresh, again in pairs)

    return {
        "kv_bytes": med(lambda f, a: f.kv_bytes),
        "prefill": med(lambda f, a: f.prefill_s),
        "ttft": med(lambda f, a: f.ttft_s),
        "exposed": med(lambda f, a: f.ttft_s - f.prefill_s),
        "whole": med(lambda f, a: a.ttft_s),
        "gbps": med(lambda f, a: a.kv_bytes * 8 / a.ttft_s / 1e9),
        "ideal": med(lambda f, a: f.kv_bytes * 8 / (mbit * 1e6)) if mbit else float("nan"),
        "no_overlap": med(lambda f, a: f.prefill_s + a.ttft_s),
        "one_layer": med(lambda f, a: f.prefill_s + a.ttft_s / num_layers),
        "hidden": med(lambda f, a: 1 - (f.ttft_s - f.prefill_s) / a.ttft_s),
        "decode_xfer": med(lambda f, a: f.decode_xfer_s),
    }


HEADER = ("| backend | prompt tok | link | KV MB/req | prefill s (P) | TTFT s | TTFT - prefill ms | whole xfer ms "
          "| xfer Gbit/s | KV/rate ms | no-overlap bound s | 1-layer bound s | hidden | D xfer s |")


def table_row(backend: str, num_tokens: int, mbit: int, s: dict[str, float]) -> str:
    link = "uncapped" if not mbit else f"{mbit / 1000:g} Gbit/s"
    ideal = "-" if not mbit else f"{s['ideal'] * 1e3:.0f}"
    return (f"| {backend} | {num_tokens} | {link} | {s['kv_bytes'] / 1e6:.1f} | {s['prefill']:.3f} | {s['ttft']:.3f} "
            f"| {s['exposed'] * 1e3:.0f} | {s['whole'] * 1e3:.0f} | {s['gbps']:.2f} | {ideal} "
            f"| {s['no_overlap']:.3f} | {s['one_layer']:.3f} | {s['hidden']:.0%} | {s['decode_xfer']:.3f} |")


def cpu_description() -> str:
    """lscpu's model name and which of CPU_FLAGS (native bf16 / AMX) it lists."""
    fields = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True,
                                                                 check=True).stdout.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    present = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS)
    return f"{fields.get('Model name', '?').strip()}, {os.cpu_count()} CPUs; {present}"


# -- main ----------------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int_list, default=[1024, 4096], help="prompt lengths, comma-separated")
    p.add_argument("--rates", type=int_list, default=[0, 10000, 1000],
                   help="link caps in Mbit/s, comma-separated; 0 = uncapped")
    p.add_argument("--repeats", type=int, default=3, help="fresh + repeated prompt pairs per point (median)")
    p.add_argument("--kv-backends", type=lambda text: [b for b in text.split(",") if b.strip()], default=["tcp"],
                   help=f"kvtransfer backends to measure in turn, comma-separated, of {', '.join(KV_BACKENDS)}")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--chunked-prefill-size", type=int, default=0, help="workers' flag; 0: the engine's auto "
                   "(512 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    if not args.prompt_tokens or not args.rates or args.repeats < 1 or args.max_tokens < 1:
        p.error("need prompt lengths, rates, --repeats >= 1 and --max-tokens >= 1")
    if not args.kv_backends or set(args.kv_backends) - set(KV_BACKENDS):
        p.error(f"--kv-backends: one or more of {', '.join(KV_BACKENDS)}")
    if min(args.prompt_tokens) <= BLOCK_SIZE or min(args.rates) < 0:
        p.error(f"prompts must be longer than {BLOCK_SIZE} tokens and rates >= 0")
    return args


def _raise_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)   # unwinds through the finally blocks that stop everything


def _load(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def print_log_tails(log_dir: Path, lines: int = 20) -> None:
    for log in sorted(log_dir.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- last lines of {log.name}:\n" + "\n".join(tail), file=sys.stderr)


def run(cluster: NetnsCluster, args: argparse.Namespace, log_dir: Path, secret: str,
        backend: str) -> list[tuple[int, int, str]]:
    """Start the services, measure every point, stop the services; (rate, prompt tokens, row) each."""
    services = start_services(cluster, args, log_dir, backend)
    try:
        for service in services.all():
            service.wait_ready(args.startup_timeout_s)
        register_workers(services.router.info["grpc"], services, secret)
        metrics = {"prefill": services.prefill.info["metrics"], "decode": services.decode.info["metrics"]}
        num_layers = load_arch(resolve_model(args.model)).num_layers
        rng = random.Random(args.seed)
        node_b = cluster.nodes[1]
        rows = []
        with TandemClient(services.router.info["grpc"], timeout_s=300.0) as client:
            wait_healthy(client)
            for num_tokens in args.prompt_tokens:   # warm-up, uncapped, not counted
                measure_point(client, metrics, rng, num_tokens, WARMUP_PAIRS, args.max_tokens, backend, node_b)
            for mbit in args.rates:
                set_rate(cluster, mbit)
                for num_tokens in args.prompt_tokens:
                    t0 = time.monotonic()
                    pairs = measure_point(client, metrics, rng, num_tokens, args.repeats, args.max_tokens, backend,
                                          node_b)
                    rows.append((mbit, num_tokens, table_row(backend, num_tokens, mbit, summarize(pairs, mbit,
                                                                                                   num_layers))))
                    print(f"done in {time.monotonic() - t0:.0f} s: {rows[-1][2]}", flush=True)
        return rows
    finally:
        for service in reversed(services.all()):
            stop(cluster, service)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = missing_requirements()
    if why:
        print(f"cluster_kv: {why}", file=sys.stderr)
        return 2
    for name in PROXY_VARIABLES:   # every byte stays on the namespaces' bridge
        os.environ.pop(name, None)
        os.environ.pop(name.upper(), None)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    secret = new_secret()
    os.environ[SECRET_ENV] = secret       # the services inherit this deployment's secret
    load = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="tandem-cluster-kv-"))
    log_dir = root / "logs"
    log_dir.mkdir()
    try:
        with NetnsCluster(root / "cluster", nodes=2) as cluster:
            rows = [row for backend in args.kv_backends for row in run(cluster, args, log_dir, secret, backend)]
    except Exception:
        print_log_tails(log_dir)
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\ncommand: {shlex.join([sys.executable, *sys.argv])}")
    print(f"cpu: {cpu_description()}")
    print(f"load average at start: {_load(load)}; at the end: {_load(os.getloadavg())}")
    print(f"model {args.model}, {args.num_threads} torch thread(s) per worker, max_tokens {args.max_tokens}, "
          f"chunked prefill {args.chunked_prefill_size or 'auto'}, {args.repeats} repeats (medians); P + router in "
          f"node A, D in node B; kvtransfer {', '.join(args.kv_backends)} (tcp: CurveZMQ; nixl: UCX, unencrypted)\n")
    print(HEADER)
    print("|---" * (HEADER.count("|") - 1) + "|")
    # One backend after another was measured; the table puts each point's backends side by side.
    rows.sort(key=lambda row: (args.rates.index(row[0]), args.prompt_tokens.index(row[1])))
    print("\n".join(row for _, _, row in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
