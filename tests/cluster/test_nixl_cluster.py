"""KV over NIXL between nodes: prefill and decode on different namespace nodes with
``--kv-backend nixl`` give the tcp backend's greedy text, the KV visibly crosses the nodes'
links, and a decode node lost mid-transfer costs no stream (docs/cluster.md).

One namespace cluster (tests/cluster/netns.py) for the module, no Ray: the router, prefill and
decode worker processes are started inside the nodes and registered with the router by
Admin.RegisterWorker, as deploy/controller.py does (benchmarks/cluster_kv.py does the same):

    n0  the router (--local-prefill-max-tokens 0: every prompt goes P -> D)
    n1  the prefill worker
    n2  a decode worker      n3  a decode worker

First a tcp pair (P on n1, D on n2) serves the prompts; its text is the reference. Then
nixl workers replace it on n1, n2 and n3. Nodes are separate network namespaces, hostnames and
/dev/shm, so UCX has only the bridge between them: what the workers count as shipped must show
up in the nodes' interface byte counters, and the decode worker's ZeroMQ receiver (which counts
the tcp backend's payload) must see none of it.

The failure tests cap n2's link and act while KV flows into it, as test_cluster.py loses a node:
one freezes n2 (the prefill worker's NIXL writes there stop completing, and its per-write
deadline, ``--kv-lease-s``, must end them), then kills it; the other boots n2 again with a new
decode worker and kills it outright (UCX sees the sockets close: no write may wait for its
deadline). Either way every stream ends whole on n3 and the prefill worker lets go of it all.

NIXL is loaded only by the worker processes, never into this pytest process: UCX once left a
CI run's pytest process to die later, in an unrelated test (kvtransfer/nixl.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deploy.launch import REPO_ROOT, ServiceProcess
from protos.auth import SECRET_ENV, SecretStub, new_secret
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from router.config import READY_PREFIX as ROUTER_READY_PREFIX
from tests.cluster.netns import NetnsCluster, Node, missing_requirements
from tests.cluster.streams import Streams
from tests.metrics import metric, scrape
from worker.process import READY_PREFIX as WORKER_READY_PREFIX

pytestmark = pytest.mark.slow

KV_LEASE_S = 3.0                 # the receivers' lease and the prefill worker's deadline per NIXL write
NUM_STREAMS = 12
MAX_TOKENS = 48                  # + the longest prompt (184) stays within the tiny model's 256
CAP_MBIT = 2                     # the lost decode node's link: a prompt's KV takes ~0.3 s to cross it
START_TIMEOUT_S = 180
BLOCK_SIZE = 16                  # the workers' --block-size default


def _prompt(i: int) -> list[int]:
    rng = __import__("random").Random(3000 + i)
    return [rng.randrange(3, 49000) for _ in range(96 + 8 * i)]


PROMPTS = [_prompt(i) for i in range(NUM_STREAMS)]


def nixl_missing() -> str | None:
    """Why the worker processes cannot load NIXL, or None; asked in a child process, so this
    one never loads it."""
    done = subprocess.run([sys.executable, "-c", "from kvtransfer.nixl import bindings; bindings()"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


def rx_bytes(node: Node) -> int:
    """Bytes ``node`` has received on its link: what the bridge's end of its veth pair sent."""
    return int(Path(f"/sys/class/net/{node.host_veth}/statistics/tx_bytes").read_text())


def tx_bytes(node: Node) -> int:
    return int(Path(f"/sys/class/net/{node.host_veth}/statistics/rx_bytes").read_text())


def prompts_kv_nbytes(model: Path) -> int:
    """The KV of PROMPTS as the prefill worker counts what it shipped: each prompt's whole blocks
    (ceil(len / BLOCK_SIZE)), every (layer, K|V) plane, float32."""
    config = json.loads((model / "config.json").read_text())
    block_nbytes = BLOCK_SIZE * config["num_key_value_heads"] * config["head_dim"] * 4
    num_blocks = sum(-(-len(prompt) // BLOCK_SIZE) for prompt in PROMPTS)
    return num_blocks * config["num_hidden_layers"] * 2 * block_nbytes


def wait_for_metric(worker: ServiceProcess, name: str, at_least: float, timeout_s: float = 20.0) -> float:
    """``name`` of ``worker``'s /metrics once it reached ``at_least`` (its value then)."""
    deadline = time.monotonic() + timeout_s
    while (value := metric(scrape(worker.info["metrics"]), name)) < at_least:
        assert time.monotonic() < deadline, f"{name} of {worker.name} is {value}, not {at_least}"
        time.sleep(0.05)
    return value


class Cluster:
    """The namespace nodes, the router on n0, and the workers started on them."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model = root, model
        cache = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
        cache.mkdir(parents=True, exist_ok=True)
        # Nodes share the checkout and this machine's compiled CPU kernels (see test_cluster.py).
        self.net = NetnsCluster(root / "net", nodes=4, keep=[REPO_ROOT, cache])
        self.router_node, self.prefill_node, *self.decode_nodes = self.net.nodes
        self.secret = new_secret()
        self.env = {SECRET_ENV: self.secret, "TANDEM_CACHE_DIR": str(cache)}
        self.logs = root / "logs"
        self.logs.mkdir()
        self.services: list[ServiceProcess] = []
        self.workers: list[tuple[str, ServiceProcess]] = []     # registered with the router: (role, worker)
        self.router = self._start("router", self.router_node, [
            "-m", "router", "--model", str(model), "--host", self.router_node.ip, "--grpc-port", "0",
            "--http-port", "0", "--local-prefill-max-tokens", "0"], ROUTER_READY_PREFIX)
        self.router.wait_ready(START_TIMEOUT_S)
        self.url = f"http://{self.router.info['http']}"

    def _start(self, name: str, node: Node, args: list[str], ready_prefix: str) -> ServiceProcess:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child writes it until it exits
        # UCX as a deployment's node has it: its own choice of transports (tests/kvtransfer's conftest
        # puts UCX_TLS in this process's environment when it runs in the same session).
        argv = ["env", "-u", "UCX_TLS", sys.executable, *args]
        service = ServiceProcess(name, self.net.exec_argv(node, argv), ready_prefix,
                                 stderr=log, env=self.env, die_with_parent=True)
        self.services.append(service)
        return service

    def start_workers(self, backend: str, nodes: list[tuple[str, Node]]) -> list[ServiceProcess]:
        """Workers of ``backend`` (role, node), all loading at once, then registered with the router."""
        started = [self._start(f"{role}-{backend}-{node.name}", node, [
            "-m", f"{role}_worker", "--model", str(self.model), "--dtype", "float32", "--host", node.ip,
            "--port", "0", "--kv-backend", backend, "--kv-lease-s", str(KV_LEASE_S), "--num-threads", "1",
            "--num-gpu-blocks-override", "256"], WORKER_READY_PREFIX) for role, node in nodes]
        for service in started:
            service.wait_ready(START_TIMEOUT_S)
        with self._admin() as admin:
            for (role, _), service in zip(nodes, started):
                admin.RegisterWorker(admin_pb2.RegisterWorkerRequest(role=role, address=service.info["grpc"]),
                                     timeout=10.0, wait_for_ready=True)
        self.workers += [(role, service) for (role, _), service in zip(nodes, started)]
        self.wait_healthy()
        return started

    def stop_workers(self, workers: list[ServiceProcess]) -> None:
        with self._admin() as admin:
            for w in workers:
                admin.DeregisterWorker(admin_pb2.DeregisterWorkerRequest(address=w.info["grpc"]), timeout=10.0)
        for w in workers:
            self.net.terminate(w.proc)
            w.stop()
        self.workers = [(role, w) for role, w in self.workers if w not in workers]

    @contextlib.contextmanager
    def _admin(self) -> Iterator[SecretStub]:
        with grpc.insecure_channel(self.router.info["grpc"]) as channel:
            yield SecretStub(admin_pb2_grpc.AdminStub(channel), self.secret)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until the router has as many healthy workers of each role as run here (it lists no addresses)."""
        from tandem_client import TandemClient

        running = Counter(role for role, w in self.workers if w.proc.poll() is None)
        deadline = time.monotonic() + timeout_s
        with TandemClient(self.router.info["grpc"], timeout_s=10.0) as client:
            while (healthy := Counter(w.role for w in client.cluster() if w.healthy)) != running:
                assert time.monotonic() < deadline, f"healthy at the router: {healthy}, running: {running}"
                time.sleep(0.2)

    def close(self) -> None:
        try:
            for service in reversed(self.services):
                self.net.terminate(service.proc, timeout_s=5.0)
                service.stop()
        finally:
            self.net.stop()
            for log in sorted(self.logs.glob("*.log")):
                tail = log.read_text(errors="replace").splitlines()[-15:]
                print(f"--- {log.name}:\n" + "\n".join(tail))


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model) -> Cluster:
    why = missing_requirements() or nixl_missing()
    if why:
        pytest.skip(f"a namespace cluster over nixl: {why}")
    c = Cluster(tmp_path_factory.mktemp("nixl-cluster"), model)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def tcp_text(cluster) -> list[str]:
    """The greedy text of a tcp pair (P on n1, D on n2); the KV crossed as tcp payload."""
    workers = cluster.start_workers("tcp", [("prefill", cluster.prefill_node), ("decode", cluster.decode_nodes[0])])
    try:
        text = Streams(cluster.url, PROMPTS, MAX_TOKENS).join_result()
        kv_nbytes = prompts_kv_nbytes(cluster.model)
        sent = wait_for_metric(workers[0], "tandem_kv_transfer_bytes_total", kv_nbytes)
        received = metric(scrape(workers[1].info["metrics"]), "tandem_kv_received_bytes_total")
        # A block that one prefill chunk fills in part goes again with the next: received may exceed it.
        assert sent == kv_nbytes and received >= sent, (kv_nbytes, sent, received)
        return text
    finally:
        cluster.stop_workers(workers)


@pytest.fixture(scope="module")
def nixl(cluster, tcp_text) -> dict[str, ServiceProcess]:
    """nixl workers: P on n1, D on n2 and n3 (after the tcp pair is gone)."""
    p, d2, d3 = cluster.start_workers("nixl", [("prefill", cluster.prefill_node),
                                               ("decode", cluster.decode_nodes[0]),
                                               ("decode", cluster.decode_nodes[1])])
    return {"prefill": p, "decode": d2, "other_decode": d3}


# -- tests -------------------------------------------------------------------------------------


def test_nixl_between_nodes_gives_the_tcp_text_and_the_kv_crosses_the_links(cluster, nixl, tcp_text):
    p, decodes = nixl["prefill"], [nixl["decode"], nixl["other_decode"]]
    kv_nbytes = prompts_kv_nbytes(cluster.model)
    before_rx = [rx_bytes(n) for n in cluster.decode_nodes]
    before_tx = tx_bytes(cluster.prefill_node)
    before_p = scrape(p.info["metrics"])

    assert Streams(cluster.url, PROMPTS, MAX_TOKENS).join_result() == tcp_text

    shipped = wait_for_metric(p, "tandem_kv_transfer_bytes_total",
                              metric(before_p, "tandem_kv_transfer_bytes_total") + kv_nbytes
                              ) - metric(before_p, "tandem_kv_transfer_bytes_total")
    after_p = scrape(p.info["metrics"])
    node_rx = sum(rx_bytes(n) - b for n, b in zip(cluster.decode_nodes, before_rx))
    node_tx = tx_bytes(cluster.prefill_node) - before_tx
    zmq_payload = sum(metric(scrape(d.info["metrics"]), "tandem_kv_received_bytes_total") for d in decodes)
    print(f"KV of {NUM_STREAMS} prompts: {kv_nbytes} B, shipped {shipped:.0f} B; decode nodes received "
          f"{node_rx} B, the prefill node sent {node_tx} B; ZeroMQ KV payload {zmq_payload:.0f} B")
    assert shipped == kv_nbytes
    assert metric(after_p, "tandem_kv_transfer_failures_total") == 0
    # The bytes crossed the links between the nodes, and not as the tcp backend's payload: UCX moved them.
    assert zmq_payload == 0
    assert node_rx >= shipped and node_tx >= shipped, (node_rx, node_tx, shipped)


def _stream_into(cluster: Cluster, node: Node, victim: ServiceProcess) -> Streams:
    """Streams started with ``node``'s link capped, once ``victim`` (the decode worker on it)
    waits for KV and KV is flowing into the node: a prompt's KV is 48-92 KiB and the victim's
    share of the streams' ~0.5 MB, taking ~2 s at the cap, so what comes next lands mid-writes."""
    cluster.net.cap(node, CAP_MBIT)
    rx_start = rx_bytes(node)
    streams = Streams(cluster.url, PROMPTS, MAX_TOKENS)
    deadline = time.monotonic() + 60
    while (metric(scrape(victim.info["metrics"]), "tandem_num_requests_transferring") < 1
           or rx_bytes(node) - rx_start < 64 * 1024):
        assert time.monotonic() < deadline and streams.is_alive(), "no KV transfer to the victim node"
        time.sleep(0.02)
    return streams


def _streams_whole_and_prefill_let_go(cluster: Cluster, p: ServiceProcess, streams: Streams, failovers: float,
                                      tcp_text: list[str]) -> None:
    """Every stream whole (on the other decode node), some failed over, and the prefill worker
    holds no transfer or block for the lost node and still serves."""
    assert streams.join_result() == tcp_text
    moved = metric(scrape(cluster.router.info["http"]), "tandem_request_failovers_total") - failovers
    assert moved >= 1, "no request failed over from the lost node"
    deadline = time.monotonic() + 2 * KV_LEASE_S + 10
    while (held := [metric(scrape(p.info["metrics"]), name)
                    for name in ("tandem_num_requests_transferring", "tandem_kv_cache_usage_ratio")]) != [0, 0]:
        assert time.monotonic() < deadline, f"the prefill worker still holds transfers or blocks: {held}"
        time.sleep(0.2)
    assert Streams(cluster.url, PROMPTS[:2], MAX_TOKENS).join_result() == tcp_text[:2]


def _victim(cluster: Cluster, nixl: dict[str, ServiceProcess]) -> ServiceProcess:
    """The nixl decode worker on n2; after an earlier test's power cut, n2 booted again with a new one."""
    node = cluster.decode_nodes[0]
    if nixl["decode"].proc.poll() is not None:
        if not node.alive:
            cluster.net.restart(node)
        [nixl["decode"]] = cluster.start_workers("nixl", [("decode", node)])
    return nixl["decode"]


def test_decode_node_frozen_mid_transfer_fails_the_write_at_its_deadline_then_lost_streams_finish_elsewhere(
        cluster, nixl, tcp_text):
    p, victim, node = nixl["prefill"], _victim(cluster, nixl), cluster.decode_nodes[0]
    failovers = metric(scrape(cluster.router.info["http"]), "tandem_request_failovers_total")
    failed = metric(scrape(p.info["metrics"]), "tandem_kv_transfer_failures_total")
    streams = _stream_into(cluster, node, victim)
    cluster.net.freeze(node)                        # mid-transfer: its NIXL writes stop completing ...
    frozen_at = time.monotonic()
    try:
        # ... and the prefill worker's deadline fails them: it does not wait on a stopped peer forever.
        # Two clocks of the same length may fire first: the write's own deadline, or the eviction of
        # its sender once it made no progress for as long (which fails the write as "sender closed").
        wait_for_metric(p, "tandem_kv_transfer_failures_total", failed + 1, timeout_s=KV_LEASE_S + 30)
        print(f"a transfer to the frozen node failed {time.monotonic() - frozen_at:.1f} s after the freeze "
              f"(deadline {KV_LEASE_S} s)")
        logged = (cluster.logs / f"{p.name}.log").read_text(errors="replace")
        assert "not done by its deadline" in logged or " ops stalled for " in logged, logged[-2000:]
    finally:
        cluster.net.kill(node)                      # ... and the node is gone: a power cut (and no test
                                                    # after this one meets a frozen node)
    _streams_whole_and_prefill_let_go(cluster, p, streams, failovers, tcp_text)


def test_decode_node_killed_mid_transfer_streams_finish_elsewhere_and_no_write_waits_for_its_deadline(
        cluster, nixl, tcp_text):
    p, victim, node = nixl["prefill"], _victim(cluster, nixl), cluster.decode_nodes[0]
    failovers = metric(scrape(cluster.router.info["http"]), "tandem_request_failovers_total")
    log = cluster.logs / f"{p.name}.log"
    streams = _stream_into(cluster, node, victim)
    logged = log.stat().st_size
    cluster.net.kill(node)                          # a power cut while KV flows into it
    killed_at = time.monotonic()
    _streams_whole_and_prefill_let_go(cluster, p, streams, failovers, tcp_text)
    # UCX saw the peer's sockets close: the write in flight failed then (or its request was aborted
    # by the failover first). A write left waiting would have stalled the sender for its deadline,
    # and the prefill worker logs that sender's eviction ("N ops stalled") once it passed.
    time.sleep(max(0.0, killed_at + KV_LEASE_S + 2 - time.monotonic()))
    with open(log, "rb") as f:
        f.seek(logged)
        since = f.read().decode(errors="replace").splitlines()
    waited = [line for line in since if "stalled" in line or "by its deadline" in line]
    assert not waited, waited
