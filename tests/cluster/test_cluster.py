"""Tandem on a real multi-node cluster: `ray up` across namespace nodes, KV between machines, and
nodes and links failing under running streams (docs/cluster.md).

One namespace cluster (tests/cluster/netns.py) for the whole module, brought up with the shipped
deploy/ray/cluster-local.yaml changed only in its machines and login (plus the test's tiny model
and `tandem serve` placement flags, and this checkout's venv linked in place of the installer):

    n0  Ray head: the controller (and `tandem serve`, `tandem status` run here)
    n1  the router (--router-node, --host 0.0.0.0) and a prefill replica
    n2  prefill (after `tandem scale prefill 2`)
    n3  decode          n4  decode (after `tandem scale decode 2`)
    x0  an outsider on the same bridge, holding no secret

Every worker asks for 1.5 CPUs of a node's 2, so one per node: a replica whose node dies waits
for that node to come back. The tests run in order and each leaves the cluster as it found it
(every desired replica running). Failures are injected while streams run; greedy text is compared
with the colocated engine (`engine.llm.LLM`) on the same prompts: one unbroken stream, nothing
lost or duplicated.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from deploy.launch import REPO_ROOT
from tests.cluster.netns import NetnsCluster, Node, missing_requirements
from tests.cluster.streams import Streams
from tests.deploy.ray_launcher import launcher_home, ray_cli
from tests.metrics import metric, scrape

pytestmark = pytest.mark.slow

SHIPPED_YAML = REPO_ROOT / "deploy/ray/cluster-local.yaml"
TANDEM = Path(sys.executable).parent / "tandem"
UP_TIMEOUT_S = 600
SETTLE_TIMEOUT_S = 240
KV_LEASE_S = 5.0
MAX_TOKENS = 200                         # the tiny model's context is 256
NUM_STREAMS = 16
RETRIABLE = ("service_unavailable",)          # error types (HTTP 503) a client may retry


def _prompt(i: int) -> list[int]:
    rng = __import__("random").Random(1000 + i)
    return [rng.randrange(3, 49000) for _ in range(16 + i)]


class Deployment:
    """The namespace cluster, the Ray cluster `ray up` made on it, and Tandem on top."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root = root
        self.model = model
        cache = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
        cache.mkdir(parents=True, exist_ok=True)
        # The nodes share the checkout (with its venv) and this machine's compiled CPU kernels
        # (a real node would build its own: minutes of compiling on 2 cores).
        self.net = NetnsCluster(root / "net", nodes=5, outsiders=1, keep=[REPO_ROOT, cache],
                                env={"TANDEM_CACHE_DIR": str(cache)} if "TANDEM_CACHE_DIR" in os.environ else {})
        self.head, self.n1, self.n2, self.n3, self.n4 = self.net.nodes
        self.outsider = self.net.outsiders[0]
        self.launcher_home = launcher_home(root)       # `ray up` runs with HOME here: ~/.ray/auth_token
        self.config_path = root / "cluster.yaml"
        self.sd_file = root / "targets.json"
        self.log: list[str] = []

    # -- bring-up ----------------------------------------------------------------------------

    def config(self) -> dict:
        config = yaml.safe_load(SHIPPED_YAML.read_text())
        config["cluster_name"] = f"tandem-netns-{self.net.id}"
        config["provider"].update(head_ip=self.head.ip, worker_ips=[n.ip for n in self.net.nodes[1:]])
        config["auth"] = {"ssh_user": self.net.user, "ssh_private_key": str(self.net.client_key)}
        installs = [i for i, cmd in enumerate(config["setup_commands"]) if "bash scripts/setup.sh" in cmd]
        assert len(installs) == 1, config["setup_commands"]
        config["setup_commands"][installs[0]] = f"ln -sfn {REPO_ROOT / '.venv'} ~/tandem/.venv"
        serves = [i for i, cmd in enumerate(config["head_start_ray_commands"]) if " serve --address auto" in cmd]
        assert len(serves) == 1, config["head_start_ray_commands"]
        config["head_start_ray_commands"][serves[0]] += (
            f" --model {self.model} --dtype float32 --http-port 0 --grpc-port 0 --host 0.0.0.0"
            f" --router-node {self.n1.ip} --prefill-nodes {self.n1.ip},{self.n2.ip}"
            f" --decode-nodes {self.n3.ip},{self.n4.ip} --cpus-per-worker 1.5 --kv-lease-s {KV_LEASE_S}"
            f" --num-gpu-blocks-override 256 --prometheus-sd-file {self.sd_file}")
        return config

    def ray(self, *args: str, timeout_s: float) -> tuple[int, str]:
        rc, out = ray_cli(*args, home=self.launcher_home, timeout_s=timeout_s)
        self.log.append(f"$ ray {' '.join(args)} (exit {rc})\n{out[-6000:]}")
        return rc, out

    def up(self) -> None:
        self.config_path.write_text(yaml.safe_dump(self.config()))
        rc, out = self.ray("up", "-y", str(self.config_path), "--no-config-cache", "--log-style", "record",
                           timeout_s=UP_TIMEOUT_S)
        assert rc == 0, f"`ray up` failed:\n{out[-6000:]}"

    def down(self) -> None:
        self.ray("down", "-y", str(self.config_path), "--log-style", "record", timeout_s=180)
        self.net.stop()

    # -- the CLI on the head -----------------------------------------------------------------

    def tandem(self, *args: str, timeout_s: float = 300) -> str:
        return self.net.ssh(self.head, f"RAY_AUTH_MODE=token {TANDEM} {' '.join(args)}", timeout_s=timeout_s)

    def status(self) -> dict:
        return json.loads(self.tandem("status", "--json", timeout_s=60))

    def settled(self, timeout_s: float = SETTLE_TIMEOUT_S) -> dict:
        """Wait until every desired replica runs and the router is up; the status."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status = self.status()
            except Exception as exc:  # noqa: BLE001 - the head may be busy; retry until the deadline
                status = {"error": str(exc)}
            workers = status.get("workers", [])
            counts = {r: sum(w["role"] == r and w["state"] == "running" for w in workers)
                      for r in ("prefill", "decode")}
            if (status.get("router", {}).get("state") == "running" and counts == status.get("desired")
                    and len(workers) == sum(counts.values())):
                return status
            if time.monotonic() > deadline:
                pytest.fail(f"not settled after {timeout_s} s: {json.dumps(status, indent=1)}")
            time.sleep(2)

    def restart_node(self, node: Node) -> None:
        """Boot a killed node and join it to Ray with the shipped YAML's worker start command."""
        self.net.restart(node)
        start = yaml.safe_load(SHIPPED_YAML.read_text())["worker_start_ray_commands"][-1]
        self.net.ssh(node, start.replace("$RAY_HEAD_IP", self.head.ip), timeout_s=120)

    # -- serving -----------------------------------------------------------------------------

    def router_url(self) -> str:
        return f"http://{self.n1.ip}:{self.status()['router']['http'].rsplit(':', 1)[1]}"

    def targets(self) -> dict[str, dict]:
        """The Prometheus file_sd targets the controller keeps, by replica."""
        return {g["labels"]["replica"]: {"target": g["targets"][0], **g["labels"]}
                for g in json.loads(self.sd_file.read_text())}

    def worker(self, status: dict, role: str, node: Node) -> dict:
        found = [w for w in status["workers"] if w["role"] == role and w["node"] == node.ip]
        assert len(found) == 1, (role, node.ip, status["workers"])
        return found[0]


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def expected(model) -> list[str]:
    """The colocated engine's greedy text for each stream's prompt: what one node gives."""
    from engine.config import SamplingParams
    from engine.llm import LLM

    llm = LLM(str(model), dtype="float32", device="cpu", num_gpu_blocks_override=256)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return [out.text for out in llm.generate([_prompt(i) for i in range(NUM_STREAMS)], params)]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def dep(tmp_path_factory, model) -> Deployment:
    why = missing_requirements()
    if why:
        pytest.skip(f"a namespace cluster {why}")
    d = Deployment(tmp_path_factory.mktemp("cluster"), model)
    try:
        d.up()
        d.settled()
        yield d
    finally:
        try:
            d.down()
        finally:
            print("\n\n".join(d.log))


# -- the cluster serves --------------------------------------------------------------------------


def test_ray_up_places_roles_on_their_nodes_and_kv_crosses_the_network(dep, expected):
    status = dep.settled()
    assert status["router"]["node"] == dep.n1.ip, status["router"]
    prefill = [w for w in status["workers"] if w["role"] == "prefill"]
    decode = [w for w in status["workers"] if w["role"] == "decode"]
    assert [w["node"] for w in prefill] in ([dep.n1.ip], [dep.n2.ip]), prefill
    assert [w["node"] for w in decode] in ([dep.n3.ip], [dep.n4.ip]), decode
    # Workers bind and advertise their node's own address, never a wildcard or loopback.
    for w in status["workers"]:
        assert w["address"].rsplit(":", 1)[0] == w["node"], w

    from openai import OpenAI

    client = OpenAI(base_url=f"{dep.router_url()}/v1", api_key="unused", max_retries=0, timeout=120)
    got = [client.completions.create(model=client.models.list().data[0].id, prompt=_prompt(i),
                                     max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text for i in range(2)]
    assert got == expected[:2]

    # The KV crossed the network: the decode worker's receiver took it over tcp (CurveZMQ).
    targets = dep.targets()
    d = targets[decode[0]["id"]]
    assert d["node"] == decode[0]["node"] and d["target"].startswith(decode[0]["node"] + ":"), targets
    received = metric(scrape(d["target"]), "tandem_kv_received_bytes_total")
    sent = metric(scrape(targets[prefill[0]["id"]]["target"]), "tandem_kv_transfer_bytes_total")
    assert received > 0 and received == sent, (received, sent)


def test_scale_decode_adds_a_replica_on_another_node(dep):
    out = dep.tandem("scale", "decode", "2", "--timeout-s", str(SETTLE_TIMEOUT_S))
    status = dep.settled()
    nodes = sorted(w["node"] for w in status["workers"] if w["role"] == "decode")
    assert nodes == sorted([dep.n3.ip, dep.n4.ip]), out


def test_an_outsider_on_the_network_is_refused_everywhere(dep):
    status = dep.settled()
    prefill = next(w for w in status["workers"] if w["role"] == "prefill")
    decode = next(w for w in status["workers"] if w["role"] == "decode")
    decode_node = next(n for n in dep.net.nodes if n.ip == decode["node"])
    kv_ports = _listening_ports(dep, decode_node, decode["pid"]) - {int(decode["address"].rsplit(":", 1)[1])}
    kv_ports -= {int(dep.targets()[decode["id"]]["target"].rsplit(":", 1)[1])}
    assert kv_ports, "found no kvtransfer port of the decode worker"
    probe = {"ray_gcs": f"{dep.head.ip}:6379", "ray_client": f"{dep.head.ip}:10001",
             "ray_dashboard": f"{dep.head.ip}:8265", "prefill_grpc": prefill["address"],
             "decode_grpc": decode["address"],
             "router_admin": f"{dep.n1.ip}:{status['router']['grpc'].rsplit(':', 1)[1]}",
             "kvtransfer": [f"{decode['node']}:{p}" for p in sorted(kv_ports)]}
    env = {"PATH": os.environ["PATH"], "HOME": str(dep.root / "outsider-home"), "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": str(REPO_ROOT)}
    (dep.root / "outsider-home").mkdir(exist_ok=True)
    done = subprocess.run(dep.net.exec_argv(dep.outsider, [sys.executable, str(REPO_ROOT / "tests/cluster/outsider.py"),
                                                           json.dumps(probe)]),
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    print("the outsider's knocks:", json.dumps(results, indent=1))
    let_in = {name: why for name, (refused, why) in results.items() if not refused}
    assert not let_in, f"the outsider got in: {let_in}\n{done.stderr[-3000:]}"
    assert set(results) == {"ray_gcs", "ray_gcs_wrong_token", "ray_client", "ray_dashboard", "prefill_grpc",
                            "decode_grpc", "router_admin", "kvtransfer_plain"}, results


LISTENING = """
import os, sys
pid = sys.argv[1]
inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
          if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
for line in open(f"/proc/{pid}/net/tcp").read().splitlines()[1:]:
    fields = line.split()
    if fields[3] == "0A" and fields[9] in inodes:      # LISTEN, this process's socket
        print(int(fields[1].rsplit(":", 1)[1], 16))
"""


def _listening_ports(dep: Deployment, node: Node, pid: int) -> set[int]:
    """TCP ports process ``pid`` (of ``node``'s PID namespace) listens on."""
    done = subprocess.run(dep.net.exec_argv(node, [sys.executable, "-c", LISTENING, str(pid)]),
                          capture_output=True, text=True, timeout=60, check=True)
    return {int(port) for port in done.stdout.split()}


# -- failures --------------------------------------------------------------------------------


def test_decode_node_lost_streams_resume_on_the_other_decode_node(dep, expected):
    status = dep.settled()
    assert sum(w["role"] == "decode" for w in status["workers"]) == 2
    url = dep.router_url()
    failovers = metric(httpx.get(f"{url}/metrics").text, "tandem_request_failovers_total")
    streams = Streams(url, [_prompt(i) for i in range(NUM_STREAMS)], MAX_TOKENS)
    streams.wait_until_streaming()
    dep.net.freeze(dep.n3)                          # the node stops here, mid-stream ...
    dep.net.kill(dep.n3)                            # ... and is gone: a power cut
    assert streams.join_result() == expected        # every stream whole: no token lost or repeated
    moved = metric(httpx.get(f"{url}/metrics").text, "tandem_request_failovers_total") - failovers
    assert moved >= 1, "no stream was on the lost node when it went"

    dep.restart_node(dep.n3)                        # the controller puts the replica back on it
    back = dep.settled()
    assert sorted(w["node"] for w in back["workers"] if w["role"] == "decode") == sorted([dep.n3.ip, dep.n4.ip])


def test_prefill_node_lost_mid_prefill_requests_are_prefilled_again(dep, expected):
    dep.tandem("scale", "prefill", "2", "--timeout-s", str(SETTLE_TIMEOUT_S))
    status = dep.settled()
    assert sorted(w["node"] for w in status["workers"] if w["role"] == "prefill") == sorted([dep.n1.ip, dep.n2.ip])
    url = dep.router_url()
    frozen = dep.worker(status, "prefill", dep.n2)["address"]
    failovers = metric(httpx.get(f"{url}/metrics").text, "tandem_request_failovers_total")
    dep.net.freeze(dep.n2)           # its prefill worker takes requests and computes none of them
    streams = Streams(url, [_prompt(i) for i in range(NUM_STREAMS)], MAX_TOKENS)
    deadline = time.monotonic() + 60
    while not next(w["num_inflight"] for w in dep.status()["workers"] if w["address"] == frozen):
        assert time.monotonic() < deadline, "no request went to the frozen prefill worker"
        time.sleep(0.2)
    dep.net.kill(dep.n2)             # mid-prefill: those requests' KV never left it
    assert streams.join_result() == expected
    moved = metric(httpx.get(f"{url}/metrics").text, "tandem_request_failovers_total") - failovers
    assert moved >= 1, moved
    dep.restart_node(dep.n2)
    dep.settled()
    dep.tandem("scale", "prefill", "1", "--timeout-s", str(SETTLE_TIMEOUT_S))
    dep.settled()


def test_partition_between_prefill_and_decode_fails_within_the_lease_and_frees_every_block(dep, expected):
    status = dep.settled()
    prefill = next(w for w in status["workers"] if w["role"] == "prefill")
    p_node = next(n for n in dep.net.nodes if n.ip == prefill["node"])
    url = dep.router_url()
    cut_off = dep.targets()[dep.worker(status, "decode", dep.n3)["id"]]["target"]
    failed = metric(scrape(cut_off), "tandem_kv_transfer_failures_total")
    dep.net.partition(p_node, dep.n3)            # P <-> one D cut; the router still sees both
    try:
        started = time.monotonic()
        streams = Streams(url, [_prompt(i) for i in range(NUM_STREAMS)], MAX_TOKENS)
        outcomes = streams.outcomes(timeout_s=120)        # nothing hangs
        took = time.monotonic() - started
        print("outcomes across the partition:", outcomes)
        for outcome, text in zip(outcomes, expected):
            # Failed over to the reachable decode node (whole text), or a clear, retriable error.
            assert outcome == text or (isinstance(outcome, dict) and outcome["error"]["type"] in RETRIABLE), outcome
    finally:
        dep.net.heal(p_node, dep.n3)
    # The cut was crossed: the decode worker behind it gave up on transfers (its lease ran out).
    assert metric(scrape(cut_off), "tandem_kv_transfer_failures_total") > failed
    print(f"{NUM_STREAMS} requests across the partition ended in {took:.1f} s (lease {KV_LEASE_S} s)")
    targets = dep.targets()
    deadline = time.monotonic() + 3 * KV_LEASE_S + 10
    while True:
        usage = {w["id"]: metric(scrape(targets[w["id"]]["target"]), "tandem_kv_cache_usage_ratio")
                 for w in dep.settled()["workers"]}
        if not any(usage.values()):
            break
        assert time.monotonic() < deadline, f"KV blocks still held after the partition: {usage}"
        time.sleep(1)
    assert Streams(url, [_prompt(i) for i in range(2)], MAX_TOKENS).join_result() == expected[:2]


def test_router_node_lost_clients_get_errors_and_status_says_so(dep, expected):
    dep.settled()
    url = dep.router_url()
    dep.net.kill(dep.n1)                    # the router's node (and a prefill replica) gone
    started = time.monotonic()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/v1/models", timeout=30)
    assert time.monotonic() - started < 10, "a client of the lost router hung instead of failing"
    deadline = time.monotonic() + 60
    while (router := dep.status()["router"])["state"] != "down":
        assert time.monotonic() < deadline, router
        time.sleep(1)
    text = dep.tandem("status")
    assert f"node {dep.n1.ip}, down)" in text and f"router: {router['error'].split(';')[0]}" in text, text
    dep.restart_node(dep.n1)
    dep.settled()
    assert Streams(dep.router_url(), [_prompt(0)], MAX_TOKENS).join_result() == expected[:1]
