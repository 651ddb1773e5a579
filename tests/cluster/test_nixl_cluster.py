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
nixl workers replace it on n1, n2 and n3. The last test caps n2's link, freezes n2 while KV is
flowing into it (the prefill worker's NIXL writes there stop completing: its per-write deadline,
``--kv-lease-s``, must end them) and then kills it, as test_cluster.py loses a node: every
stream ends whole on n3. Nodes are separate network namespaces, hostnames and
/dev/shm, so UCX has only the bridge between them: what the workers count as shipped must show up
in the nodes' interface byte counters, and the decode worker's ZeroMQ receiver (which counts the
tcp backend's payload) must see none of it.

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
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deploy.launch import REPO_ROOT, ServiceProcess
from engine.serving.process import READY_PREFIX as WORKER_READY_PREFIX
from protos.auth import SECRET_ENV, SecretStub, new_secret
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from router.config import READY_PREFIX as ROUTER_READY_PREFIX
from tests.cluster.netns import NetnsCluster, Node, missing_requirements
from tests.cluster.streams import Streams, metric, scrape

# Session fixtures that build the tiny HF checkpoint (imported so pytest registers them here).
from tests.engine.conftest import smollm2_gguf, smollm2_tokenizer, tiny_model_dir, tokenizer_files  # noqa: F401

pytestmark = pytest.mark.slow

KV_LEASE_S = 3.0                 # the receivers' lease and the prefill worker's deadline per NIXL write
NUM_STREAMS = 12
MAX_TOKENS = 48                  # + the longest prompt (184) stays within the tiny model's 256
CAP_MBIT = 2                     # the lost decode node's link: a prompt's KV takes ~0.3 s to cross it
START_TIMEOUT_S = 180


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
        self.wait_healthy(sorted(role for role, _ in nodes))
        return started

    def stop_workers(self, workers: list[ServiceProcess]) -> None:
        with self._admin() as admin:
            for w in workers:
                admin.DeregisterWorker(admin_pb2.DeregisterWorkerRequest(address=w.info["grpc"]), timeout=10.0)
        for w in workers:
            self.net.terminate(w.proc)
            w.stop()

    @contextlib.contextmanager
    def _admin(self) -> Iterator[SecretStub]:
        with grpc.insecure_channel(self.router.info["grpc"]) as channel:
            yield SecretStub(admin_pb2_grpc.AdminStub(channel), self.secret)

    def healthy_roles(self) -> list[str]:
        from router.client import TandemClient

        with TandemClient(self.router.info["grpc"], timeout_s=10.0) as client:
            return sorted(w.role for w in client.cluster() if w.healthy)

    def wait_healthy(self, roles: list[str], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (healthy := self.healthy_roles()) != roles:
            assert time.monotonic() < deadline, f"healthy at the router: {healthy}, not {roles}"
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
def model(tiny_model_dir) -> Path:  # noqa: F811 - the imported fixture
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
        received = metric(scrape(workers[1].info["metrics"]), "tandem_kv_received_bytes_total")
        # The prefill worker counts a transfer once its engine thread next looks, maybe after the stream ended.
        sent = wait_for_metric(workers[0], "tandem_kv_transfer_bytes_total", received)
        assert received > 0 and received == sent, (received, sent)
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
    config = json.loads((cluster.model / "config.json").read_text())
    token_nbytes = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    before_rx = [rx_bytes(n) for n in cluster.decode_nodes]
    before_tx = tx_bytes(cluster.prefill_node)
    before_p = scrape(p.info["metrics"])

    assert Streams(cluster.url, PROMPTS, MAX_TOKENS).join_result() == tcp_text

    after_p = scrape(p.info["metrics"])
    shipped = metric(after_p, "tandem_kv_transfer_bytes_total") - metric(before_p, "tandem_kv_transfer_bytes_total")
    node_rx = sum(rx_bytes(n) - b for n, b in zip(cluster.decode_nodes, before_rx))
    node_tx = tx_bytes(cluster.prefill_node) - before_tx
    zmq_payload = sum(metric(scrape(d.info["metrics"]), "tandem_kv_received_bytes_total") for d in decodes)
    kv_nbytes = sum(map(len, PROMPTS)) * token_nbytes
    print(f"KV of {NUM_STREAMS} prompts: >= {kv_nbytes} B (tokens), shipped {shipped:.0f} B "
          f"(whole blocks); decode nodes received {node_rx} B, the prefill node sent {node_tx} B; "
          f"ZeroMQ KV payload {zmq_payload:.0f} B")
    assert shipped >= kv_nbytes
    assert metric(after_p, "tandem_kv_transfer_failures_total") == 0
    # The bytes crossed the links between the nodes, and not as the tcp backend's payload: UCX moved them.
    assert zmq_payload == 0
    assert node_rx >= shipped and node_tx >= shipped, (node_rx, node_tx, shipped)


def test_decode_node_lost_mid_transfer_streams_finish_on_the_other_and_prefill_does_not_hang(
        cluster, nixl, tcp_text):
    p, victim = nixl["prefill"], nixl["decode"]
    node = cluster.decode_nodes[0]
    router_failovers = metric(scrape(cluster.router.info["http"]), "tandem_request_failovers_total")
    failed = metric(scrape(p.info["metrics"]), "tandem_kv_transfer_failures_total")
    cluster.net.cap(node, CAP_MBIT)                 # KV into the victim takes a while to cross its link
    rx_start = rx_bytes(node)
    streams = Streams(cluster.url, PROMPTS, MAX_TOKENS)
    # Until the victim waits for KV and KV is flowing into its node (a prompt's KV is 48-92 KiB,
    # its requests' ~0.5 MB takes ~2 s at the cap): the freeze lands in the middle of the writes.
    deadline = time.monotonic() + 60
    while (metric(scrape(victim.info["metrics"]), "tandem_num_requests_transferring") < 1
           or rx_bytes(node) - rx_start < 64 * 1024):
        assert time.monotonic() < deadline and streams.is_alive(), "no KV transfer to the victim node"
        time.sleep(0.02)
    cluster.net.freeze(node)                        # mid-transfer: its NIXL writes stop completing ...
    frozen_at = time.monotonic()
    # ... and the prefill worker's deadline fails them: it does not wait on a stopped peer forever.
    wait_for_metric(p, "tandem_kv_transfer_failures_total", failed + 1, timeout_s=KV_LEASE_S + 30)
    print(f"a transfer to the frozen node failed {time.monotonic() - frozen_at:.1f} s after the freeze "
          f"(deadline {KV_LEASE_S} s)")
    assert "not done by its deadline" in (cluster.logs / f"{p.name}.log").read_text(errors="replace")
    cluster.net.kill(node)                          # ... and the node is gone: a power cut
    assert streams.join_result() == tcp_text         # every stream whole, on the other decode node
    moved = metric(scrape(cluster.router.info["http"]), "tandem_request_failovers_total") - router_failovers
    assert moved >= 1, "no request failed over from the lost node"

    # The prefill worker let go of everything it had for the lost node and still serves.
    deadline = time.monotonic() + 2 * KV_LEASE_S + 10
    while (held := [metric(scrape(p.info["metrics"]), name)
                    for name in ("tandem_num_requests_transferring", "tandem_kv_cache_usage_ratio")]) != [0, 0]:
        assert time.monotonic() < deadline, f"the prefill worker still holds transfers or blocks: {held}"
        time.sleep(0.2)
    assert Streams(cluster.url, PROMPTS[:2], MAX_TOKENS).join_result() == tcp_text[:2]
