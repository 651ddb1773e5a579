"""A cluster of machines on this one: Linux network namespaces on a private bridge (docs/cluster.md).

Each **node** is a network namespace with its own address on a veth pair to a bridge, plus its
own mount, PID and UTS namespaces: its own hostname (so Tandem's "same host" test -- hostname and
boot id -- tells nodes apart and picks the tcp KV backend between them), its own process table
(a PID namespace: ``ray stop`` on one node stops only that node's Ray), its own ``/dev/shm``
(a fresh tmpfs: no node maps another's KV pool) and its own ``/tmp/ray`` (a Ray node each). Its
first process is an ``sshd`` on port 22 of the node's address that logs in one throwaway key as
the current user. The user's home directory is the node's own (a folder of the harness bound
over it in the node's mount namespace, so ``~`` means it for every program, ssh's ``-i ~/...``
included): what ``ray up`` installs under ``~`` (the checkout, the bootstrap key and config,
Ray's token) lands per node. The rest of the file system is shared, as an NFS mount would be,
and so are the folders under the home given as ``keep`` (and this Python's installation).

The bridge has an address (``.1``) in this namespace, so this process reaches every node
directly (``ray up``, ssh, HTTP); no node has a route anywhere but the bridge, which leads
nowhere else. An **outsider** is a namespace on the same bridge with no sshd and no secrets: the
stranger on the cluster's network.

Faults:
- ``cap(node, mbit)``: a token-bucket filter (tc tbf) on both ends of the node's link;
- ``link_down(node)`` / ``link_up(node)``: the node's cable pulled and put back;
- ``partition(a, b)`` / ``heal(a, b)``: packets between two nodes dropped silently (each
  side's neighbour entry for the other points nowhere), everything else still flows;
- ``kill(node)``: SIGKILL to every process in the node's namespace (a power cut: its sockets
  close, its /dev/shm and mounts vanish); ``restart(node)`` boots it again (sshd, clean
  /tmp/ray and /dev/shm).

Needs root and iproute2 (``ip``, ``tc``), util-linux (``nsenter``, ``unshare``), OpenSSH and
rsync; ``missing_requirements()`` says what is missing. Everything is named ``tdm<id>...`` and
removed by ``stop()``; a cluster whose owner died is removed by the next ``remove_stale()``.

By hand (Ctrl-C removes it all)::

    sudo .venv/bin/python -m tests.cluster.netns --nodes 3 --outsiders 1
"""
from __future__ import annotations

import argparse
import getpass
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.sshd import make_keys, missing_binaries, sshd_binary, sshd_config

SUBNET_PREFIX = "10.213"          # nodes get 10.213.<k>.<10 + i>, outsiders .<200 + i>, this host .1
REGISTRY = Path("/run/tandem-netns")   # <id>.pid: the owner of each live cluster
PARTITION_MAC = "02:00:00:de:ad:01"  # locally administered; no interface here has it
# The PID 1 of a node: runs its argument vector and reaps every process that ends up its child
# (orphans of the node are reparented to it); exits, taking the node down, once none is left.
INIT = """
import os, sys
os.spawnvp(os.P_NOWAIT, sys.argv[1], sys.argv[1:])
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""
TOOLS = ("ip", "tc", "nsenter", "unshare")
SSH_OPTIONS = ("-o", "StrictHostKeyChecking=no", "-o", f"UserKnownHostsFile={os.devnull}",
               "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10")


class NetnsError(RuntimeError):
    pass


def missing_requirements() -> str | None:
    """Why a namespace cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None] + missing_binaries()
    if missing:
        return (f"missing {', '.join(missing)} (apt-get install iproute2 util-linux openssh-server "
                "openssh-client rsync)")
    return None


def _run(*argv: str, check: bool = True, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _free_subnet() -> str:
    used = _run("ip", "-o", "-4", "addr", "show").stdout + _run("ip", "-4", "route", "show").stdout
    start = secrets.randbelow(200)
    for k in range(256):
        third = (start + k) % 250 + 1
        if f"{SUBNET_PREFIX}.{third}." not in used:
            return f"{SUBNET_PREFIX}.{third}"
    raise NetnsError(f"no free {SUBNET_PREFIX}.x.0/24 subnet on this host")


@dataclass(eq=False)
class Node:
    name: str                 # tdm<id>-n0: the namespace and the hostname
    ip: str
    host_veth: str            # this namespace's end of the node's link (on the bridge)
    root: Path                # the node's own files: home/, tmp-ray/, sshd.log
    ssh: bool = True          # False: an outsider (no sshd, nothing running)
    keeper: subprocess.Popen | None = field(default=None, repr=False)   # `unshare`, the init's parent
    init_pid: int = 0         # the node's PID 1, as this namespace sees it

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def alive(self) -> bool:
        return self.keeper is not None and self.keeper.poll() is None


class NetnsCluster:
    """``nodes`` nodes and ``outsiders`` outsiders on one bridge; see the module docstring.

    ``env`` is set in every ssh session on the nodes (sshd SetEnv). ``keep``: folders under the
    user's home that every node still shares (a checkout, a cache); this Python's installation
    always is.
    """

    def __init__(self, root: Path, nodes: int, outsiders: int = 0, env: dict[str, str] | None = None,
                 keep: list[Path] = (), start_timeout_s: float = 30.0) -> None:
        why = missing_requirements()
        if why:
            raise NetnsError(why)
        remove_stale()
        self.root = root
        self.id = secrets.token_hex(2)
        self.user = getpass.getuser()
        self.home = Path(pwd.getpwuid(os.getuid()).pw_dir)   # each node mounts its own home here
        wanted = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, *keep)}
        self.keep = sorted(p for p in wanted if p.is_relative_to(self.home) and p != self.home)
        self.env = dict(env or {})
        self.bridge = f"tdm{self.id}br"
        self.client_key = root / "client_key"
        self.start_timeout_s = start_timeout_s
        self.nodes: list[Node] = []
        self.outsiders: list[Node] = []
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / f"{self.id}.pid").write_text(str(os.getpid()))
        try:
            self.subnet = _free_subnet()
            root.mkdir(parents=True, exist_ok=True)
            make_keys(root, "host_key", "client_key")
            (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(nodes):
                self.nodes.append(self._make_node(f"n{i}", f"{self.subnet}.{10 + i}", ssh=True))
            for i in range(outsiders):
                self.outsiders.append(self._make_node(f"x{i}", f"{self.subnet}.{200 + i}", ssh=False))
            for node in self.nodes + self.outsiders:
                self._boot(node)
        except BaseException:
            self.stop()
            raise

    # -- nodes -------------------------------------------------------------------------------

    def _make_node(self, short: str, ip: str, ssh: bool) -> Node:
        name = f"tdm{self.id}-{short}"
        node = Node(name, ip, f"tdm{self.id}{short}", self.root / short, ssh)
        node.home.mkdir(parents=True)
        (node.home / ".bashrc").touch()        # Ray's commands source it
        (node.root / "tmp-ray").mkdir()
        peer = f"tdm{self.id}{short}p"
        _run("ip", "netns", "add", name)
        _run("ip", "link", "add", node.host_veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", name)
        _run("ip", "-n", name, "link", "set", peer, "name", "eth0")
        _run("ip", "-n", name, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "-n", name, "link", "set", "eth0", "up")
        # An on-link default route: software that finds its address by "routing" to a public one
        # (Ray does) sees eth0's; a packet that really goes there finds no one on the bridge.
        _run("ip", "-n", name, "route", "add", "default", "dev", "eth0")
        _run("ip", "link", "set", node.host_veth, "master", self.bridge)
        _run("ip", "link", "set", node.host_veth, "up")
        if ssh:
            (node.root / "sshd_config").write_text(sshd_config(
                f"{ip}:22", self.root / "host_key", node.root / "sshd.pid", self.root / "authorized_keys",
                self.user, self.home) + "".join(f"SetEnv {k}={v}\n" for k, v in self.env.items()))
        return node

    def _boot(self, node: Node) -> None:
        """Start the node's first process in fresh PID, mount and UTS namespaces inside its network
        namespace: its own process table (so `ray stop` on one node stops only that node's Ray),
        /dev/shm, /tmp/ray and hostname, then sshd (an outsider: nothing)."""
        for stale in (node.root / "tmp-ray").iterdir():
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink()
        Path("/tmp/ray").mkdir(exist_ok=True)       # the mount point (this namespace's stays as it was)
        first = f"exec {sshd_binary()} -D -e -f {node.root / 'sshd_config'}" if node.ssh else "exec sleep infinity"
        keep = ""
        for path in self.keep:                        # bound into the node's home, then the home over ~
            inside = node.home / path.relative_to(self.home)
            inside.mkdir(parents=True, exist_ok=True)
            keep += f"mount --bind {path} {inside} && "
        script = (f"mount -t tmpfs -o mode=1777 tmpfs /dev/shm && mount --bind {node.root / 'tmp-ray'} /tmp/ray "
                  f"&& {keep}mount --rbind {node.home} {self.home} && hostname {node.name} && {first}")
        with open(node.root / "sshd.log", "ab") as log:
            node.keeper = subprocess.Popen(
                ["ip", "netns", "exec", node.name, "unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc",
                 "--propagation", "private", sys.executable, "-c", INIT, "sh", "-c", script],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        node.init_pid = self._init_pid(node)
        if node.ssh:
            self._wait_for_login(node)

    def _init_pid(self, node: Node, timeout_s: float = 10.0) -> int:
        """The pid (as seen here) of the node's PID 1: the child `unshare --fork` made."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node.keeper is None or node.keeper.poll() is not None:
                raise NetnsError(f"{node.name} did not boot: {(node.root / 'sshd.log').read_text(errors='replace')}")
            try:
                children = Path(f"/proc/{node.keeper.pid}/task/{node.keeper.pid}/children").read_text().split()
            except OSError:
                children = []
            if children:
                return int(children[0])
            time.sleep(0.02)
        raise NetnsError(f"{node.name}: no init process after {timeout_s} s")

    def _wait_for_login(self, node: Node) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if node.keeper is not None and node.keeper.poll() is not None:
                raise NetnsError(f"{node.name}: sshd exited ({node.keeper.returncode}): "
                                 f"{(node.root / 'sshd.log').read_text(errors='replace')[-2000:]}")
            probe = subprocess.run(self.ssh_command(node, "hostname"), capture_output=True, text=True, timeout=30)
            if probe.returncode == 0:
                if probe.stdout.strip() != node.name:
                    raise NetnsError(f"{node.ip} answers as {probe.stdout.strip()!r}, not {node.name}")
                return
            if time.monotonic() > deadline:
                raise NetnsError(f"cannot log in to {node.name} at {node.ip}: {probe.stderr.strip()}")
            time.sleep(0.2)

    def ssh_command(self, node: Node, *remote: str) -> list[str]:
        return ["ssh", "-i", str(self.client_key), *SSH_OPTIONS, f"{self.user}@{node.ip}", *remote]

    def ssh(self, node: Node, command: str, timeout_s: float = 120.0, check: bool = True) -> str:
        """Run ``command`` in a login shell on ``node``; its stdout (stderr appended on failure)."""
        done = subprocess.run(self.ssh_command(node, command), capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise NetnsError(f"{node.name}: `{command}` failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        return done.stdout

    def exec_argv(self, node: Node, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs inside ``node``'s namespaces (network, mount, PID, hostname).

        nsenter forks to enter the PID namespace and does not pass signals on: stop a service
        started this way by signalling its own pid (nsenter's child), not nsenter's."""
        if not node.alive:
            raise NetnsError(f"{node.name} is down")
        return ["nsenter", "--target", str(node.init_pid), "--net", "--mount", "--uts", "--pid", "--", *argv]

    def terminate(self, proc: subprocess.Popen, timeout_s: float = 10.0) -> int | None:
        """SIGTERM to a service started with ``exec_argv`` (to nsenter's child: nsenter passes no
        signal on, and signalling it alone would orphan the service in its node), then wait for
        nsenter; its exit code, or None if it still runs after ``timeout_s``."""
        try:
            for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
                os.kill(int(pid), signal.SIGTERM)
        except OSError:
            pass
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def pids(self, node: Node) -> list[int]:
        return [int(p) for p in _run("ip", "netns", "pids", node.name, check=False).stdout.split()]

    def freeze(self, node: Node) -> list[int]:
        """SIGSTOP every process in ``node``: it stops answering mid-whatever, as a hung machine
        does (``kill`` after it is a power cut at that instant)."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        return pids

    def kill(self, node: Node, timeout_s: float = 20.0) -> int:
        """SIGKILL every process in ``node`` (a power cut); returns how many there were."""
        deadline = time.monotonic() + timeout_s
        killed: set[int] = set()
        while pids := self.pids(node):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise NetnsError(f"{node.name}: processes still alive after SIGKILL: {pids}")
            time.sleep(0.05)
        if node.keeper is not None:
            node.keeper.wait(timeout_s)
        return len(killed)

    def restart(self, node: Node) -> None:
        """Boot a killed node again: a fresh /dev/shm and /tmp/ray, sshd; nothing else runs."""
        if node.alive:
            raise NetnsError(f"{node.name} is running; kill it first")
        self._boot(node)

    # -- the network -------------------------------------------------------------------------

    def cap(self, node: Node, mbit: float) -> None:
        """Cap ``node``'s link at ``mbit`` Mbit/s in each direction (tc tbf on both ends)."""
        rate_bytes = mbit * 1e6 / 8
        burst = max(128 * 1024, int(rate_bytes * 0.002))   # 2 ms of traffic, and a GSO super-packet
        qdisc = ["root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms"]
        _run("tc", "qdisc", "replace", "dev", node.host_veth, *qdisc)
        _run("ip", "netns", "exec", node.name, "tc", "qdisc", "replace", "dev", "eth0", *qdisc)

    def uncap(self, node: Node) -> None:
        _run("tc", "qdisc", "del", "dev", node.host_veth, "root", check=False)
        _run("ip", "netns", "exec", node.name, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    def link_down(self, node: Node) -> None:
        _run("ip", "link", "set", node.host_veth, "down")

    def link_up(self, node: Node) -> None:
        _run("ip", "link", "set", node.host_veth, "up")

    def partition(self, a: Node, b: Node) -> None:
        """Drop every packet between ``a`` and ``b``, silently, as a broken path between them
        would; both still reach everyone else. Each side's neighbour entry for the other points
        at a MAC address no one on the bridge has (this kernel has no tc drop action)."""
        for src, dst in ((a, b), (b, a)):
            _run("ip", "-n", src.name, "neigh", "replace", dst.ip, "lladdr", PARTITION_MAC, "nud", "permanent",
                 "dev", "eth0")

    def heal(self, a: Node, b: Node) -> None:
        for src, dst in ((a, b), (b, a)):
            _run("ip", "-n", src.name, "neigh", "del", dst.ip, "dev", "eth0", check=False)

    # -- teardown ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Kill every node and remove the namespaces, links and bridge (also after a failure)."""
        for node in self.nodes + self.outsiders:
            try:
                if _run("ip", "netns", "pids", node.name, check=False).returncode == 0:
                    self.kill(node)
            except NetnsError:
                pass
            _run("ip", "netns", "del", node.name, check=False)
            _run("ip", "link", "del", node.host_veth, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        (REGISTRY / f"{self.id}.pid").unlink(missing_ok=True)

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def remove_stale() -> list[str]:
    """Remove the namespaces, links and bridges of clusters whose owner process is gone."""
    removed = []
    if not REGISTRY.is_dir():
        return removed
    for entry in REGISTRY.glob("*.pid"):
        cluster_id = entry.stem
        try:
            os.kill(int(entry.read_text()), 0)
            continue                                   # its owner still runs
        except (ProcessLookupError, ValueError):
            pass
        for ns in _run("ip", "netns", "list", check=False).stdout.split("\n"):
            name = ns.split(" ")[0]
            if name.startswith(f"tdm{cluster_id}-"):
                for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.2)
                _run("ip", "netns", "del", name, check=False)
                removed.append(name)
        for link in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
            name = link.split(":")[1].strip().split("@")[0] if ":" in link else ""
            if name.startswith(f"tdm{cluster_id}"):
                _run("ip", "link", "del", name, check=False)
                removed.append(name)
        entry.unlink(missing_ok=True)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start a namespace cluster and keep it until Ctrl-C.")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--outsiders", type=int, default=0)
    parser.add_argument("--root", type=Path, default=None, help="its files (default: a new temp folder)")
    args = parser.parse_args(argv)
    root = args.root or Path(tempfile.mkdtemp(prefix="tandem-netns-"))
    with NetnsCluster(root, args.nodes, args.outsiders) as cluster:
        for node in cluster.nodes + cluster.outsiders:
            print(f"{node.name}  {node.ip}  init pid {node.init_pid}" + ("  (outsider)" if not node.ssh else ""))
        print(f"log in: ssh -i {cluster.client_key} {cluster.user}@{cluster.nodes[0].ip}" if cluster.nodes else "")
        print(f"run in a node: nsenter --target <its init pid> --net --mount --uts --pid -- CMD; "
              f"files under {root}; Ctrl-C removes everything", flush=True)
        try:
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(main())
