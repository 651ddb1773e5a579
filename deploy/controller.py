"""The Ray side of ``tandem serve``: the controller actor and the process hosts (docs/architecture.md#orchestration).

The **controller** is a detached, named Ray actor (``tandem-controller`` in namespace
``tandem``). It holds the desired replicas per role and reconciles twice a second:

- every replica is one placement group, one bundle per TP rank, STRICT_PACK (all ranks on one
  node); a GPU bundle per rank on CUDA clusters, a small fractional CPU demand on CPU-only ones
  so router + 2 workers fit on 2 cores;
- every rank runs as ``python -m {role}_worker``, a child of a ``ProcessHost`` actor (it dies
  with the actor: PR_SET_PDEATHSIG), which reports its ready line and exit code: on CPU nodes one
  host per node runs every rank placed there and the router (the bundles only reserve the CPU
  share; each idle actor process is 100 wake-ups a second on the engine's cores), on GPU nodes
  each rank has a host of its own in its bundle, to which Ray gives the GPU;
- a new replica is registered with the router (Admin.RegisterWorker) once all its ranks are ready
  and counts as *running* once the router's heartbeat found it healthy: it takes traffic only then;
- scale-down drains (Admin.DrainWorkers, one call for the replicas one reconcile drains: no new
  requests), waits until the router has
  no request in flight on the replica, then removes it and stops its processes; of the running
  replicas it drains the emptiest (``drain_order``: fewest streams running, by the router's view),
  and the router moves a drained decode worker's requests that have no first token yet elsewhere;
- a replica whose process dies is removed from the router (its requests fail over), torn down
  and started again, right away the first time and then with a growing delay; one that keeps
  dying shows as ``crashloop`` with its last error in ``tandem status``; one that exits with
  code 2 (a configuration error) or never comes up shows as ``failed`` and is not retried;
- the router itself runs under the ``ProcessHost`` of the node ``tandem serve`` ran on (its CPU
  share reserved by a one-bundle placement group there), and is restarted (with every running
  worker re-registered) if it dies;
- the router's and every serving replica's /metrics address go to a Prometheus file_sd target
  list (``ServeSpec.prometheus_sd_file``, deploy/prometheus_sd.py), rewritten as they change;
- with ``ServeSpec.planner`` (``tandem serve --planner``) the SLO planner runs as a thread here
  (deploy/planner_loop.py): it scrapes the router's and the serving replicas' /metrics and sets
  the desired replicas per role through ``scale``, as ``tandem scale`` does.

The deployment's cluster secret (``ServeSpec.cluster_secret``, made by ``tandem serve``) reaches
the router and every worker rank in its environment (``TANDEM_CLUSTER_SECRET``), never on a
command line; the controller sends it on every admin call. On a one-node cluster
(``ServeSpec.internal_host`` = 127.0.0.1) the workers bind their gRPC, /metrics, kvtransfer and
TP store to loopback; on several nodes, the node's address.

The controller never blocks its reconcile loop on a slow start: each replica starts in its own
thread. The CLI (deploy/serve.py) talks to it with ``start``, ``status``, ``scale`` and
``shutdown``.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from deploy.launch import ServiceProcess
from deploy.planner import Capacity, Planner, PlannerConfig, profile_capacity
from deploy.planner_loop import PlannerLoop, Targets
from deploy.prometheus_sd import TargetFile, target_groups
from engine.sim.arch import sim_profile_of
from engine.sim.latency import load_profile
from protos.auth import SECRET_ENV, SecretStub
from protos.auth import metadata as secret_metadata
from protos.limits import ROLES
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc, tandem_pb2, tandem_pb2_grpc
from router.config import READY_PREFIX as ROUTER_READY_PREFIX
from worker.process import READY_PREFIX as WORKER_READY_PREFIX

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "tandem-controller"
NAMESPACE = "tandem"
CONFIG_ERROR_EXIT = 2               # workers and the router exit 2 on a bad flag / startup check
STABLE_AFTER_S = 60.0               # a replica up this long has its consecutive failures forgotten
MAX_BACKOFF_S = 60.0
CRASHLOOP_AFTER = 3                 # consecutive failures before the state reads "crashloop"
SYNC_ROUTER_S = 2.0                 # how often the router's membership is checked against ours
ROUTER_RETRY_S = 5.0                # a router that could not be restarted is tried again after this
# Whether each worker process still runs is an actor call per process: its host spent ~0.7% of a
# core on two a second here (14:20 UTC 2026-11-27, a 3-worker sim deployment), ~0.4 core for 64
# hosts on a 2-core node. The router sees a worker die at once (its session breaks) and fails
# its requests over; this check only decides the restart.
LIVENESS_CHECK_S = 2.0
# A draining replica the router still routes to is told again after this: the first call (10 s deadline) may
# have been lost on a loaded router.
DRAIN_ASK_AGAIN_S = 15.0
# What a call to the router raises when it does not answer: an RPC error; RuntimeError while no
# router runs; ValueError ("Cannot invoke RPC on closed channel") when the reconcile thread restarted
# the router and closed the channel under a call from another thread (`tandem status` failed so).
ROUTER_CALL_ERRORS = (grpc.RpcError, RuntimeError, ValueError)
TICKS_KEPT = 120                    # reconcile ticks whose wall time status reports (a minute of them)


@dataclass
class ServeSpec:
    """What ``tandem serve`` asked for; the controller's whole configuration."""

    model: str
    replicas: dict[str, int]                 # desired replicas per role
    tp: dict[str, int]                       # tensor-parallel ranks per replica, per role
    worker_flags: list[str]                  # engine knobs passed to every worker
    router_flags: list[str]                  # --host, ports, policies (not the API key)
    api_key: str = field(default="", repr=False)   # never printed, like cluster_secret
    router_node_id: str = ""                 # the node `tandem serve` ran on (the controller's)
    # Where each role may run (router, prefill, decode): node addresses or hostnames, [] = any.
    node_sets: dict[str, list[str]] = field(default_factory=dict)
    use_gpu: bool = False
    cpus_per_rank: float = 0.1
    router_cpus: float = 0.1
    started_ray: bool = False                # `tandem down` stops the Ray cluster too
    fixed_cluster: bool = False              # serve made this one-node cluster: no node will join it
    start_timeout_s: float = 900.0
    cluster_secret: str = field(default="", repr=False)   # never printed; see protos/auth.py
    internal_host: str = ""                  # workers bind this (one node: 127.0.0.1); "" = the node's IP
    prefill_nice: int = 0                    # prefill ranks' niceness on top of the other processes'
    threads: dict[str, int] = field(default_factory=dict)  # torch threads per rank, per role (0: cores / ranks)
    local_prefill: bool = False              # decode ranks prefill short prompts themselves (they get the cores)
    prometheus_sd_file: str = ""             # Prometheus file_sd target list kept current; "" = none
    planner: PlannerConfig | None = None     # the SLO planner sets the replicas (deploy/planner.py); None = off

    def secret_env(self) -> dict[str, str]:
        return {SECRET_ENV: self.cluster_secret} if self.cluster_secret else {}


NODE_ID_LABEL = "ray.io/node-id"        # a label every Ray node has


def matching_nodes(selectors: list[str], nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The alive nodes of ``ray.nodes()`` whose address or hostname is in ``selectors`` (all
    alive nodes when it is empty)."""
    alive = [n for n in nodes if n["Alive"]]
    if not selectors:
        return alive
    return [n for n in alive if n["NodeManagerAddress"] in selectors or n["NodeManagerHostname"] in selectors]


def placement_shortfall(spec: ServeSpec, desired: dict[str, int], cluster: dict[str, float]) -> str:
    """Why ``desired`` replicas can never all be placed on a cluster whose total resources are
    ``cluster`` (``ray.cluster_resources()``), or "": each rank takes one bundle (1 GPU + 1 CPU on
    GPUs, else ``cpus_per_rank`` CPU) and the router ``router_cpus``. Without this a replica
    that does not fit waits ``start_timeout_s`` for resources that never come."""
    ranks = {role: n * spec.tp[role] for role, n in desired.items()}
    bundle = {"GPU": 1.0, "CPU": 1.0} if spec.use_gpu else {"CPU": spec.cpus_per_rank}
    workers = " + ".join(f"{n} {role}" for role, n in desired.items())
    for kind, per_rank in bundle.items():
        need = sum(ranks.values()) * per_rank + (spec.router_cpus if kind == "CPU" else 0.0)
        have = cluster.get(kind, 0.0)
        if need <= have + 1e-9:
            continue
        if kind == "GPU":
            return (f"{workers} workers ({sum(ranks.values())} ranks with TP) need {need:g} GPUs; this Ray cluster "
                    f"has {have:g}: use fewer workers or add GPU nodes")
        fits = max(0.0, have - spec.router_cpus) / max(1, sum(ranks.values()))
        return (f"{workers} workers ({sum(ranks.values())} ranks) at {per_rank:g} CPU each (--cpus-per-worker) and "
                f"the router's {spec.router_cpus:g} need {need:g} CPUs; this Ray cluster has {have:g}: use "
                f"--cpus-per-worker {int(fits * 1000) / 1000:g} or less, fewer workers, or more nodes")
    return ""


# -- the process hosts: one per node for its CPU ranks and the router, one per GPU rank ---------


# Ray runs actor processes at niceness 15 (its ``worker_niceness``), and what they start inherits
# it: Tandem's router and workers would then lose every core to anything else on the node (a
# benchmark client, a shell) and their share to each other would not be ours to set. Measured
# on 2 cores, 16 streams: workers at 15 beside a client at 0 gave 171 output tok/s, at 0 273.
HOST_OPTIONS = {"runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}}, "max_restarts": 0}


@ray.remote
class ProcessHost:
    """Runs Tandem processes as its children, each under a key the controller picks.

    On a CPU node one host runs every rank and the router placed there: each Ray actor process
    wakes 100 times a second even when idle (Ray checks signals every 10 ms), and on the cores
    the engine uses every wake-up costs the engine's threads (2 cores, 8 streams of 256/128:
    one host per rank and the router served 176-196 output tok/s, with two of those three hosts
    and Ray's idle worker stopped 219-265). A GPU rank has a host of its own, to which Ray gives
    the GPU of its bundle. All methods return at once (they run on the actor's main thread,
    which the children's parent-death signal is tied to)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.procs: dict[str, ServiceProcess] = {}
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    def node(self) -> dict[str, Any]:
        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "cpus": os.cpu_count() or 1}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, key: str, argv: list[str], ready_prefix: str, env: dict[str, str], nice: int = 0) -> int:
        if key in self.procs:
            raise ValueError(f"{self.name}: a process runs under {key!r} already")
        self.procs[key] = ServiceProcess(key, argv, ready_prefix, env=env, die_with_parent=True,
                                         stderr_tail=40, nice=nice)
        return self.procs[key].pid

    def poll_ready(self, key: str) -> dict[str, Any] | None:
        """The ready line once it came; raises (with the stderr tail) when the child died first."""
        if key not in self.procs:
            raise KeyError(f"{self.name}: no process under {key!r}")
        return self.procs[key].poll_ready(0.0)

    def returncodes(self, keys: list[str]) -> list[int | None]:
        """Each child's exit code, None while it runs; -9 for a key this host does not know."""
        return [self.procs[k].returncode() if k in self.procs else -9 for k in keys]

    def stderr_tail(self, key: str) -> str:
        return self.procs[key].stderr_tail() if key in self.procs else ""

    def stop(self, keys: list[str], timeout_s: float = 10.0) -> list[int | None]:
        """SIGTERM to all of ``keys`` at once, SIGKILL to those still running after ``timeout_s``;
        their exit codes (None for unknown keys)."""
        procs = [self.procs.pop(k, None) for k in keys]
        for p in procs:
            if p is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        return [None if p is None else p.stop(max(0.0, deadline - time.monotonic())) for p in procs]


# -- the controller --------------------------------------------------------------------------


@dataclass(eq=False)
class Replica:
    id: str
    role: str
    tp: int
    state: str = "pending"        # pending starting running draining restarting crashloop failed
    hosts: list = field(default_factory=list)   # per rank: (ProcessHost handle, the key of its process there)
    own_hosts: bool = False       # the hosts are this replica's alone (GPU ranks): killed with it
    pg: Any = None
    address: str = ""
    metrics: str = ""             # rank 0's /metrics host:port
    pids: list[int] = field(default_factory=list)
    node: str = ""
    restarts: int = 0
    failures: int = 0             # consecutive
    last_error: str = ""
    next_start: float = 0.0
    up_since: float = 0.0
    ever_ready: bool = False
    busy: bool = False            # a start thread owns it
    drain_asked_s: float = 0.0    # monotonic time the router was last told to drain it


def drain_lost(r: Replica, seen: Any, now: float) -> bool:
    """Whether to tell the router again to drain ``r``, which the controller drains: the router
    lists it (``seen``, its GetCluster entry) as not draining, ``DRAIN_ASK_AGAIN_S`` after the last
    call. That call was lost (at 64 workers under load the router's answer missed its 10 s deadline
    for 15 of 16 drains), and a replica the router still routes to never empties."""
    return seen is not None and not seen.draining and now - r.drain_asked_s >= DRAIN_ASK_AGAIN_S


def drain_order(live: list[Replica], view: dict[str, Any] | None) -> list[Replica]:
    """A role's replicas in the order a scale-down removes them: those not serving (failed,
    backing off, still starting) first, newest first; then the running ones with the fewest
    streams running (a drain waits for those: the router moves the requests without a first token
    elsewhere), then the fewest requests in flight, newest first. ``live`` is in start order;
    ``view``: the router's workers by address (GetCluster), None when it did not answer."""
    def load(r: Replica) -> tuple[int, int]:
        seen = (view or {}).get(r.address)
        return (seen.num_running, seen.num_inflight) if seen is not None else (0, 0)

    ranked = sorted(enumerate(live), key=lambda ir: (ir[1].state == "running", load(ir[1]), -ir[0]))
    return [r for _, r in ranked]


def record_failure(r: Replica, error: str, now: float, config_error: bool = False) -> None:
    """A replica failed (died, or did not start): pick its next state and start time.

    The first failure restarts at once, later ones back off (2, 4, ... 60 s); a replica up for
    STABLE_AFTER_S has its count reset. From CRASHLOOP_AFTER failures in a row it reads
    ``crashloop`` (still retried); a configuration error, or a replica that never came up
    CRASHLOOP_AFTER times, is ``failed`` and left alone.
    """
    if r.up_since and now - r.up_since > STABLE_AFTER_S:
        r.failures = 0
    r.failures += 1
    r.last_error = error
    r.address, r.pids, r.up_since = "", [], 0.0
    if config_error or (not r.ever_ready and r.failures >= CRASHLOOP_AFTER):
        r.state = "failed"
        logger.error("%s failed and will not be restarted: %s", r.id, error)
        return
    delay = 0.0 if r.failures == 1 else min(MAX_BACKOFF_S, 2.0 ** (r.failures - 1))
    r.next_start = now + delay
    r.state = "crashloop" if r.failures >= CRASHLOOP_AFTER else "restarting"
    if delay:
        logger.warning("%s failed %d times in a row; next start in %.0f s: %s", r.id, r.failures, delay, error)


def cpu_threads(spec: ServeSpec, role: str, node_cpus: int, ranks: dict[str, int]) -> int:
    """Torch threads of one ``role`` rank on a CPU-only node whose worker ranks are ``ranks`` (per
    role): ``--{role}-threads``, else decode ranks get an equal share of the cores and prefill ranks
    share all of them, so prefill runs on what decode leaves (it is niced below decode). With local
    prefill on (``spec.local_prefill``) the decode ranks prefill most prompts themselves and share
    all of the cores too. Measured on 2 cores, 1P1D, `vllm bench serve`, fresh server: prefill at 2
    threads instead of 1 gave 2048-token prompts at concurrency 8 18.3 instead of 14.6 output tok/s,
    concurrency 64 422 instead of 379; decode at 2 threads with local prefill up to 4096 tokens gave
    c16 398 instead of 312 tok/s and c64 536 instead of 380 (P/D, decode at 1 thread)."""
    if spec.threads.get(role):
        return spec.threads[role]
    if role == "prefill":
        share = ranks.get("prefill", 0)
    else:
        share = ranks.get("decode", 0) if spec.local_prefill else sum(ranks.values())
    return max(1, node_cpus // max(1, share))


def worker_argvs(spec: ServeSpec, role: str, tp: int, node: dict[str, Any], ranks: dict[str, int],
                 dist_port: int | None) -> list[list[str]]:
    """The command line of each rank of a ``role`` replica on ``node`` (``ProcessHost.node``).

    Internal endpoints -- gRPC, /metrics, kvtransfer and the TP store -- bind
    ``spec.internal_host`` (127.0.0.1 on a one-node cluster), else the node's address. The
    cluster secret is not here: it travels in the environment (``ServeSpec.secret_env``).
    """
    host = spec.internal_host or node["ip"]
    flags = ["--model", spec.model, "--host", host, "--port", "0", *spec.worker_flags]
    if not spec.use_gpu and "--num-threads" not in spec.worker_flags:
        flags += ["--num-threads", str(cpu_threads(spec, role, node["cpus"], ranks))]
    if tp > 1:
        flags += ["--tensor-parallel-size", str(tp), "--dist-init-address", f"{host}:{dist_port}"]
    return [[sys.executable, "-m", f"{role}_worker", *flags, *(["--tp-rank", str(i)] if tp > 1 else [])]
            for i in range(tp)]


def remote_error(exc: BaseException, kinds: tuple[str, ...] = ("WorkerStartError",)) -> str:
    """The message of the first of ``kinds`` an exception from a Ray call carries (a
    RayTaskError's text repeats the remote traceback), else its whole text."""
    text = str(exc)
    for kind in kinds:
        marker = f"{kind}: "
        if marker in text:
            return text[text.rfind(marker) + len(marker):].strip()
    return text.strip()


@ray.remote
class Controller:
    def __init__(self, spec: ServeSpec) -> None:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s controller: %(message)s")
        self.spec = spec
        self.desired = dict(spec.replicas)
        self.replicas: list[Replica] = []
        self.router: dict[str, Any] = {}
        self._router_host: tuple[Any, str] | None = None   # (the router's node host, its key there)
        self._router_pg: Any = None   # reserves the router's CPU share on its node
        self._router_retry_at = 0.0
        self._node_hosts: dict[str, Any] = {}    # node id -> the ProcessHost of its CPU ranks and router
        self._hosts_lock = threading.Lock()
        self._keys = itertools.count()           # makes every process key unique
        self._stub: tandem_pb2_grpc.TandemStub | None = None
        self._admin: SecretStub | None = None
        self._channel: grpc.Channel | None = None
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._loop: threading.Thread | None = None
        self._ids = {role: itertools.count(0) for role in ROLES}
        self._next_sync = 0.0
        self._next_liveness = 0.0
        self._tick_s: collections.deque[float] = collections.deque(maxlen=TICKS_KEPT)   # reconcile ticks' wall s
        self._targets = TargetFile(spec.prometheus_sd_file) if spec.prometheus_sd_file else None
        self._planner: PlannerLoop | None = None
        self.planner_info: dict[str, Any] = {}

    # -- API for the CLI -----------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Start the router (raises if it cannot) and the reconcile loop; returns the router's addresses."""
        self._check_fits(self.desired)
        if self.spec.planner is not None:      # the most it may ask for, as prefill + decode
            self._check_fits({"prefill": self.spec.planner.max_workers - 1, "decode": 1})
        self._start_router()
        self._loop = threading.Thread(target=self._run, name="tandem-reconcile", daemon=True)
        self._loop.start()
        if self.spec.planner is not None:
            self._start_planner(self.spec.planner)
        return dict(self.router)

    def scale(self, role: str, count: int) -> dict[str, int]:
        if role not in ROLES:
            raise ValueError(f"role {role!r}: use prefill or decode")
        if count < 1:
            raise ValueError(f"{role} replicas must be >= 1 (got {count}): with none, every request would fail")
        with self._lock:
            self._check_fits({**self.desired, role: count})
            self.desired[role] = count
        logger.info("scale %s to %d replicas", role, count)
        return dict(self.desired)

    def _check_fits(self, desired: dict[str, int]) -> None:
        """Refuse replicas that can never be placed on the one-node cluster ``tandem serve``
        made itself; on a cluster that was there the operator (or an autoscaler) may add nodes,
        so there it is a warning and the replicas wait (``tandem status`` says for what)."""
        why = placement_shortfall(self.spec, desired, ray.cluster_resources())
        if why and self.spec.fixed_cluster:
            raise ValueError(why)
        if why:
            logger.warning("%s; the replicas that do not fit wait for resources", why)

    def status(self) -> dict[str, Any]:
        cluster = self._router_view(timeout_s=2.0, wait=False) or {}   # the router may be restarting
        with self._lock:
            workers = []
            for r in self.replicas:
                seen = cluster.get(r.address)
                # A replica that keeps dying reads "crashloop" until it serves again.
                state = "crashloop" if r.state == "starting" and r.failures >= CRASHLOOP_AFTER else r.state
                workers.append({
                    "id": r.id, "role": r.role, "address": r.address or None, "pid": r.pids[0] if r.pids else None,
                    "pids": list(r.pids), "node": r.node or None, "state": state, "tp": r.tp,
                    "failures": r.failures,
                    "num_running": seen.num_running if seen else 0, "num_waiting": seen.num_waiting if seen else 0,
                    "num_inflight": seen.num_inflight if seen else 0,
                    "num_requests": seen.num_requests if seen else 0,
                    "kv_usage": round(seen.kv_usage, 4) if seen else 0.0,
                    "restarts": r.restarts, "error": r.last_error or None})
            planner = dict(self.planner_info)
            if self._planner is not None and self._planner.decisions:
                last = self._planner.decisions[-1]
                planner["last"] = {"targets": last.targets, "reasons": {k: v.name for k, v in last.reasons.items()},
                                   "note": last.note}
            ticks = sorted(self._tick_s)
            reconcile = {"ticks": len(ticks), "p50_ms": round(ticks[len(ticks) // 2] * 1e3, 2) if ticks else None,
                         "max_ms": round(ticks[-1] * 1e3, 2) if ticks else None}
            return {"model": self.spec.model, "router": dict(self.router), "desired": dict(self.desired),
                    "started_ray": self.spec.started_ray, "workers": workers, "planner": planner,
                    "reconcile": reconcile}

    def shutdown(self) -> None:
        """Stop the loop, every worker (removed from the router first) and the router."""
        self._stopping.set()
        if self._planner is not None:
            self._planner.stop()
        if self._loop is not None:
            self._loop.join(30)
        with self._lock:
            replicas, self.replicas = list(self.replicas), []
        deadline = time.monotonic() + 30
        while any(r.busy for r in replicas) and time.monotonic() < deadline:
            time.sleep(0.1)                       # start threads notice the stop and tear down
        for r in replicas:
            self._deregister(r)
        self._teardown_many(replicas)
        if self._router_host is not None:
            host, key = self._router_host
            try:
                ray.get(host.stop.remote([key], 10.0), timeout=20)
            except Exception:  # noqa: BLE001 - best effort: the actor may be gone already
                pass
            self._router_host = None
        self._remove_router_pg()
        with self._hosts_lock:
            hosts, self._node_hosts = list(self._node_hosts.values()), {}
        for host in hosts:
            try:
                ray.kill(host)
            except Exception:  # noqa: BLE001
                pass
        if self._channel is not None:
            self._channel.close()
        if self._targets is not None:
            self._targets.publish([])             # Prometheus stops scraping what is gone
        logger.info("deployment stopped")

    # -- planner -----------------------------------------------------------------------------

    def _start_planner(self, config: PlannerConfig) -> None:
        """The planner's thread and /metrics; a simulated model's profile gives the workers'
        capacity from the start (else the planner learns it)."""
        profile = sim_profile_of(self.spec.model)
        capacity = profile_capacity(load_profile(profile), config.itl_slo_s) if profile is not None else Capacity()
        self._planner = PlannerLoop(Planner(config, capacity), self._planner_targets, self.scale, self.spec.api_key)
        address = self._planner.start(self.spec.internal_host or ray.util.get_node_ip_address())
        self.planner_info = {"metrics": address, "dry_run": config.dry_run, "ttft_slo_ms": config.ttft_slo_s * 1e3,
                             "itl_slo_ms": config.itl_slo_s * 1e3, "max_workers": config.max_workers,
                             "interval_s": config.interval_s}
        logger.info("planner: %s; capacity per worker at start: %s; /metrics at %s",
                    "dry run (logs only)" if config.dry_run else "sets the replicas", capacity, address)

    def _planner_targets(self) -> Targets | None:
        """Where the planner scrapes: the router's HTTP address (None while it is not running) and
        each serving replica's /metrics; with the replicas asked for now."""
        with self._lock:
            http = self.router.get("http")
            if self.router.get("state") != "running" or not http:
                return None
            bind, port = http.rsplit(":", 1)
            if bind in ("0.0.0.0", "[::]", "::"):
                http = f"{self.router['node']}:{port}"
            workers = {role: [r.metrics for r in self.replicas if r.role == role and r.state == "running"
                              and r.metrics] for role in ROLES}
            # A draining replica still holds its worker (on a GPU budget, its accelerator) until its
            # last stream ends; the planner counts it against --max-workers.
            held = {role: self.desired[role] + sum(r.role == role and r.state == "draining" for r in self.replicas)
                    for role in ROLES}
            return Targets(http, workers, dict(self.desired), {role: len(workers[role]) for role in ROLES}, held)

    # -- router ------------------------------------------------------------------------------

    def _start_router(self) -> None:
        spec = self.spec
        node_id = self._router_node_id() or ray.get_runtime_context().get_node_id()
        self._remove_router_pg()
        self._router_pg = placement_group([{"CPU": spec.router_cpus}], name="tandem-router",
                                          bundle_label_selector=[{NODE_ID_LABEL: f"in({node_id})"}])
        if not ray.wait([self._router_pg.ready()], timeout=60)[0]:
            raise RuntimeError(f"no room for the router's {spec.router_cpus:g} CPU on node {node_id} within 60 s")
        host = self._node_host(node_id)
        key = f"router #{next(self._keys)}"
        # A restarted router starts with the running replicas (it polls them before it opens its
        # ports); _sync_router registers what this misses (draining ones, then drains them).
        with self._lock:
            running = [(r.role, r.address) for r in self.replicas if r.state == "running" and r.address]
        argv = [sys.executable, "-m", "router", "--model", spec.model, *spec.router_flags,
                *(arg for role, address in running for arg in (f"--{role}", address))]
        env = {**({"TANDEM_API_KEY": spec.api_key} if spec.api_key else {}), **spec.secret_env()}
        deadline = time.monotonic() + 120
        try:
            pid = ray.get(host.start.remote(key, argv, ROUTER_READY_PREFIX, env))
            while (info := ray.get(host.poll_ready.remote(key))) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("the router did not report ready within 120 s")
                time.sleep(0.2)
        except Exception as exc:
            try:
                ray.get(host.stop.remote([key], 5.0), timeout=10)
            except Exception:  # noqa: BLE001 - best effort: the host may be gone with its node
                pass
            raise RuntimeError(f"router failed to start: {remote_error(exc)}") from None
        self._router_host = (host, key)
        # A restarted router must come back on the same ports, also when they were picked (0).
        for flag, address in (("--http-port", info["http"]), ("--grpc-port", info["grpc"])):
            if address and flag in spec.router_flags:
                spec.router_flags[spec.router_flags.index(flag) + 1] = address.rsplit(":", 1)[1]
        node = ray.get(host.node.remote())
        self.router = {"http": info["http"], "grpc": info["grpc"], "node": node["ip"], "pid": pid,
                       "state": "running", "error": None}
        if self._channel is not None:
            self._channel.close()
        port = info["grpc"].rsplit(":", 1)[1]
        bind = info["grpc"].rsplit(":", 1)[0]
        target = f"{node['ip']}:{port}" if bind in ("0.0.0.0", "[::]", "::") else info["grpc"]
        self._channel = grpc.insecure_channel(target)
        self._stub = tandem_pb2_grpc.TandemStub(self._channel)
        self._admin = SecretStub(admin_pb2_grpc.AdminStub(self._channel), spec.cluster_secret)
        logger.info("router ready: http %s, grpc %s", info["http"], info["grpc"])

    def _remove_router_pg(self) -> None:
        if self._router_pg is not None:
            try:
                remove_placement_group(self._router_pg)
            except Exception:  # noqa: BLE001 - best effort: its node may be gone
                pass
            self._router_pg = None

    def _node_host(self, node_id: str) -> Any:
        """The process host of a node: made on first use, and again once its process (or its node)
        died."""
        with self._hosts_lock:
            host = self._node_hosts.get(node_id)
        if host is not None:
            try:
                ray.get(host.node.remote(), timeout=30)
                return host
            except ray.exceptions.GetTimeoutError:
                return host                      # alive, busy stopping processes
            except ray.exceptions.RayActorError:
                pass
        with self._hosts_lock:
            if self._node_hosts.get(node_id) is host:    # no other thread made a new one meanwhile
                # ProcessHost.options: added by ray.remote, which the type checker does not see
                self._node_hosts[node_id] = ProcessHost.options(  # type: ignore[attr-defined]
                    **HOST_OPTIONS, num_cpus=0, name=None,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                ).remote(f"node {node_id[:8]}")
            return self._node_hosts[node_id]

    def _router_node_id(self) -> str:
        """The node the router runs on: the first alive node of ``--router-node``, else the one
        ``tandem serve`` ran on."""
        selectors = self.spec.node_sets.get("router", [])
        if not selectors:
            return self.spec.router_node_id
        nodes = matching_nodes(selectors, ray.nodes())
        if not nodes:
            raise RuntimeError(f"no node of --router-node {','.join(selectors)} is alive")
        return nodes[0]["NodeID"]

    def _router_stub(self) -> tandem_pb2_grpc.TandemStub:
        if self._stub is None:
            raise RuntimeError("the router is not running")
        return self._stub

    def _admin_stub(self) -> SecretStub:
        if self._admin is None:
            raise RuntimeError("the router is not running")
        return self._admin

    def _metadata(self) -> tuple:
        """The API key, and the cluster secret: with it GetCluster names the workers' addresses."""
        key = (("authorization", f"Bearer {self.spec.api_key}"),) if self.spec.api_key else ()
        return key + (secret_metadata(self.spec.cluster_secret) if self.spec.cluster_secret else ())

    def _register(self, r: Replica) -> None:
        self._admin_stub().RegisterWorker(admin_pb2.RegisterWorkerRequest(role=r.role, address=r.address),
                                          timeout=10.0, wait_for_ready=True)

    def _deregister(self, r: Replica) -> None:
        if not r.address:
            return
        try:
            self._admin_stub().DeregisterWorker(admin_pb2.DeregisterWorkerRequest(address=r.address),
                                                timeout=10.0, wait_for_ready=True)
        except ROUTER_CALL_ERRORS as exc:
            logger.warning("could not deregister %s from the router: %s", r.id, exc)

    def _drain(self, replicas: list[Replica]) -> None:
        """Tell the router to drain these replicas, in one call: a scale-down's drains are marked
        together, so the requests the router moves off one never land on another."""
        addresses = [r.address for r in replicas if r.address]
        if not addresses:
            return
        try:
            self._admin_stub().DrainWorkers(admin_pb2.DrainWorkersRequest(addresses=addresses),
                                            timeout=10.0, wait_for_ready=True)
        except ROUTER_CALL_ERRORS as exc:
            logger.warning("could not drain %s at the router: %s", ", ".join(r.id for r in replicas), exc)

    def _router_view(self, timeout_s: float = 5.0, wait: bool = True) -> dict[str, Any] | None:
        """The router's workers by address; None when it does not answer."""
        try:
            return {w.address: w for w in self._router_stub().GetCluster(
                tandem_pb2.GetClusterRequest(), timeout=timeout_s, metadata=self._metadata(),
                wait_for_ready=wait).workers}
        except ROUTER_CALL_ERRORS:
            return None

    # -- reconcile loop ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.wait(0.5):
            started = time.monotonic()
            try:
                self._check_router()
                if time.monotonic() >= self._next_sync:
                    self._next_sync = time.monotonic() + SYNC_ROUTER_S
                    self._sync_router()
                if time.monotonic() >= self._next_liveness:
                    self._next_liveness = time.monotonic() + LIVENESS_CHECK_S
                    self._check_replicas()
                self._reconcile()
                self._publish_targets()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad tick
                logger.exception("reconcile tick failed")
            with self._lock:
                self._tick_s.append(time.monotonic() - started)

    def _check_router(self) -> None:
        """Restart the router when it died (its process, or its node); while it cannot be
        restarted (its node is gone), ``status`` shows it down with the reason, retried every
        ROUTER_RETRY_S."""
        if self._router_host is not None:
            host, key = self._router_host
            try:
                code = ray.get(host.returncodes.remote([key]), timeout=10)[0]
                error = f"the router exited with code {code}"
                host_lives = True
            except ray.exceptions.RayActorError as exc:
                code, error = -9, f"the router's process host died: {str(exc).strip().splitlines()[0]}"
                host_lives = False
            except ray.exceptions.GetTimeoutError:
                return
            if code is None:
                return
            logger.error("%s; restarting it", error)
            if host_lives:
                host.stop.remote([key], 1.0)     # reaps it and removes what it left in shared memory
            self._router_host = None
            self.router.update(state="down", error=error, pid=None, lost_at=time.time())
        if time.monotonic() < self._router_retry_at:
            return
        try:
            self._start_router()
        except Exception as exc:  # noqa: BLE001 - keep serving status and retry
            self._router_retry_at = time.monotonic() + ROUTER_RETRY_S
            reason = self.router.get("error") or "the router is down"
            self.router.update(state="down", error=f"{reason.split('; restart failed')[0]}; restart failed: "
                                                   f"{remote_error(exc, ('RuntimeError',))}")
            logger.error("%s", self.router["error"])
            return
        self._sync_router()

    def _sync_router(self) -> None:
        """Register with the router every running (or draining) replica it does not list: after
        a router restart, or a registration lost on the way."""
        view = self._router_view()
        if view is None:
            return
        with self._lock:
            missing = [r for r in self.replicas
                       if r.state in ("running", "draining") and not r.busy and r.address not in view]
        for r in missing:
            logger.info("registering %s worker %s at %s with the router again", r.role, r.id, r.address)
            self._register(r)
        self._drain([r for r in missing if r.state == "draining"])

    def _check_replicas(self) -> None:
        """Restart (or, draining, drop) a replica one of whose ranks exited. Every host is asked
        at once and answered in one wait: asked one replica after another, 64 replicas on a
        loaded node made a tick 64 actor round trips long."""
        with self._lock:
            watched = [r for r in self.replicas if r.state in ("running", "draining") and not r.busy]
        by_host: dict[Any, list[tuple[Replica, int, str]]] = {}
        for r in watched:
            for rank, (host, key) in enumerate(r.hosts):
                by_host.setdefault(host, []).append((r, rank, key))
        asked = {host.returncodes.remote([key for _, _, key in ranks]): ranks for host, ranks in by_host.items()}
        if not asked:
            return
        answered, _ = ray.wait(list(asked), num_returns=len(asked), timeout=10)
        dead: dict[Replica, tuple[int, int]] = {}     # replica -> its lowest exited rank and code
        for ref in answered:
            ranks = asked[ref]
            try:
                codes = ray.get(ref)
            except ray.exceptions.RayActorError:      # the host died: its node, or its process
                codes = [-9] * len(ranks)
            for (r, rank, _), code in zip(ranks, codes):
                if code is not None and (r not in dead or rank < dead[r][0]):
                    dead[r] = (rank, code)
        for r, (rank, code) in dead.items():
            tail = self._tail(*r.hosts[rank]) if rank < len(r.hosts) else ""
            error = f"rank {rank} (pid {r.pids[rank] if rank < len(r.pids) else '?'}) exited with code {code}"
            logger.error("%s worker %s at %s: %s; %s", r.role, r.id, r.address, error,
                         "removing it" if r.state == "draining" else "restarting it")
            self._stop_replica(r)
            with self._lock:
                if r.state == "draining":
                    self._drop(r)
                    continue
                r.restarts += 1
                record_failure(r, error + (f"; last stderr lines:\n{tail}" if tail else ""), time.monotonic())

    def _reconcile(self) -> None:
        now = time.monotonic()
        view = None
        with self._lock:
            shrinking = any(sum(r.role == role and r.state == "running" for r in self.replicas) > self.desired[role]
                            for role in ROLES)
        # A running replica to drain: the emptiest, by the router's view (outside the lock: an RPC).
        loads = self._router_view(timeout_s=2.0, wait=False) if shrinking else None
        to_drain: list[Replica] = []
        with self._lock:
            for role in ROLES:
                live = [r for r in self.replicas if r.role == role and r.state != "draining"]
                for _ in range(self.desired[role] - len(live)):
                    r = Replica(f"{role}-{next(self._ids[role])}", role, self.spec.tp[role])
                    self.replicas.append(r)
                    live.append(r)
                surplus = len(live) - self.desired[role]
                for r in drain_order(live, loads)[:max(0, surplus)]:
                    if r.state == "running":
                        r.state = "draining"
                        seen = (loads or {}).get(r.address)
                        logger.info("draining %s worker %s at %s%s", r.role, r.id, r.address,
                                    f" ({seen.num_running} running, {seen.num_inflight} in flight)" if seen else "")
                        r.drain_asked_s = now
                        to_drain.append(r)
                    elif not r.busy:
                        self._drop(r)
                        threading.Thread(target=self._stop_replica, args=(r,), daemon=True).start()
                    else:
                        r.state = "draining"      # the start thread sees it and tears down
            to_start = [r for r in self.replicas if not r.busy and r.state in ("pending", "restarting", "crashloop")
                        and r.next_start <= now]
            for r in to_start:
                r.busy, r.state = True, "starting"
            draining = [r for r in self.replicas if r.state == "draining" and not r.busy]
        for r in to_start:
            threading.Thread(target=self._start_replica, args=(r,), name=f"start-{r.id}", daemon=True).start()
        if to_drain:
            threading.Thread(target=self._drain, args=(to_drain,), daemon=True).start()
        if draining:
            view = self._router_view()
        if view is None:
            return
        lost = [r for r in draining if drain_lost(r, view.get(r.address), now)]
        if lost:
            logger.info("%s draining but the router still routes to them: asking again", ", ".join(r.id for r in lost))
            for r in lost:
                r.drain_asked_s = now
            threading.Thread(target=self._drain, args=(lost,), daemon=True).start()
        for r in draining:
            seen = view.get(r.address)
            if r in lost:
                continue                  # stopped only once the router routes nothing new to it
            if seen is not None and seen.num_inflight:
                continue
            logger.info("%s drained; stopping it", r.id)
            self._stop_replica(r)
            with self._lock:
                self._drop(r)

    def _publish_targets(self) -> None:
        """Keep the Prometheus target file (deploy/prometheus_sd.py) in step with who serves."""
        if self._targets is not None:
            with self._lock:
                groups = target_groups(self.router, self.replicas, self.planner_info.get("metrics", ""))
            self._targets.publish(groups)

    # -- one replica -------------------------------------------------------------------------

    def _bundle(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": 1.0} if self.spec.use_gpu else {"CPU": self.spec.cpus_per_rank}

    def _start_replica(self, r: Replica) -> None:
        try:
            self._launch(r)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the replica's state
            error = remote_error(exc)
            self._stop_replica(r)            # it may have been registered before it failed
            with self._lock:
                r.busy = False
                if r.state == "draining" or self._stopping.is_set():
                    self._drop(r)
                    return
                record_failure(r, error, time.monotonic(), config_error=f"exit code {CONFIG_ERROR_EXIT})" in error)
            logger.error("%s did not start: %s", r.id, error)
            return
        with self._lock:
            r.busy = False
            if r.state == "draining" or self._stopping.is_set():
                abandon = True
            else:
                abandon = False
                r.state, r.ever_ready, r.up_since, r.last_error = "running", True, time.monotonic(), ""
        if abandon:
            self._stop_replica(r)
            with self._lock:
                self._drop(r)
            return
        logger.info("%s worker %s is serving at %s (pid %s, node %s)", r.role, r.id, r.address, r.pids[0], r.node)

    def _placement_group(self, r: Replica) -> tuple[Any, tuple[str, ...]]:
        """A placement group for ``r``'s ranks on one node of its role's node set (alive now),
        and the ids of the nodes it may use; (None, ()) while no node of the set is alive."""
        selectors = self.spec.node_sets.get(r.role, [])
        labels = None
        ids: tuple[str, ...] = ()
        if selectors:
            ids = tuple(sorted(n["NodeID"] for n in matching_nodes(selectors, ray.nodes())))
            if not ids:
                return None, ()
            labels = [{NODE_ID_LABEL: f"in({','.join(ids)})"}] * r.tp
        pg = placement_group([self._bundle() for _ in range(r.tp)], strategy="STRICT_PACK", name=f"tandem-{r.id}",
                             bundle_label_selector=labels)
        return pg, ids

    def _place(self, r: Replica) -> None:
        """Wait until ``r``'s placement group is placed. A node of its set that dies or comes back
        (with a new node id) while it waits gets a new placement group over the nodes alive now."""
        spec = self.spec
        selectors = spec.node_sets.get(r.role, [])
        r.pg, ids = self._placement_group(r)
        waited = 0.0
        while not self._ready_or_stop(None if r.pg is None else r.pg.ready(), 5.0):
            waited += 5.0
            where = f" on a node of --{r.role}-nodes {','.join(selectors)}" if selectors else " on one node"
            r.last_error = (f"waiting {waited:.0f} s for resources: {r.tp} x {self._bundle()}{where} "
                            + ("(none of them is alive)" if r.pg is None
                               else f"(cluster has {ray.available_resources()})"))
            if waited >= spec.start_timeout_s:
                raise RuntimeError(r.last_error)
            if selectors:
                now = tuple(sorted(n["NodeID"] for n in matching_nodes(selectors, ray.nodes())))
                if now != ids:
                    if r.pg is not None:
                        remove_placement_group(r.pg)
                    r.pg, ids = self._placement_group(r)

    def _launch(self, r: Replica) -> None:
        spec = self.spec
        self._place(r)
        n = next(self._keys)
        keys = [f"{r.id} rank {i} #{n}" for i in range(r.tp)]
        if spec.use_gpu:     # each rank's own host, in its bundle: Ray gives that actor the bundle's GPU
            bundle = self._bundle()
            # ProcessHost.options: added by ray.remote, which the type checker does not see
            r.hosts = [(ProcessHost.options(  # type: ignore[attr-defined]
                            **HOST_OPTIONS, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                            scheduling_strategy=PlacementGroupSchedulingStrategy(r.pg, placement_group_bundle_index=i)
                        ).remote(f"{r.id} rank {i}"), keys[i]) for i in range(r.tp)]
            r.own_hosts = True
        else:                # the bundles reserve the CPU share; the node's host runs the ranks
            node_id = ray.util.placement_group_table(r.pg)["bundles_to_node_id"][0]
            host = self._node_host(node_id)
            r.hosts = [(host, key) for key in keys]
        node = ray.get(r.hosts[0][0].node.remote())
        r.node = node["ip"]
        with self._lock:
            if spec.internal_host:       # one node: every rank of the deployment shares its cores
                ranks = {role: self.desired[role] * spec.tp[role] for role in ROLES}
            else:                        # several: the ranks placed on this replica's node
                ranks = {role: sum(x.tp for x in self.replicas if x.role == role and x.node == r.node)
                         for role in ROLES}
        dist_port = ray.get(r.hosts[0][0].free_port.remote()) if r.tp > 1 else None
        argvs = worker_argvs(spec, r.role, r.tp, node, ranks, dist_port)
        nice = spec.prefill_nice if r.role == "prefill" and not spec.use_gpu else 0
        env = spec.secret_env()   # OpenMP's short spins: engine/__init__.py
        r.pids = ray.get([h.start.remote(key, argv, WORKER_READY_PREFIX, env, nice)
                          for (h, key), argv in zip(r.hosts, argvs)])
        deadline = time.monotonic() + spec.start_timeout_s
        infos: list[dict | None] = [None] * r.tp
        while not all(infos):
            if self._stopping.is_set() or r.state == "draining":
                raise RuntimeError("stopped while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {spec.start_timeout_s:.0f} s")
            pending = [i for i, info in enumerate(infos) if info is None]
            for i, info in zip(pending, ray.get([r.hosts[i][0].poll_ready.remote(r.hosts[i][1]) for i in pending])):
                infos[i] = info
            if not all(infos):
                time.sleep(0.2)
        ready = [info for info in infos if info is not None]   # all of them, by the loop above
        r.address = ready[0]["grpc"]
        r.metrics = ready[0].get("metrics") or ""
        r.pids = [info["pid"] for info in ready]
        self._register(r)
        # Traffic comes only after the router's heartbeat found it healthy.
        while True:
            view = self._router_view() or {}
            seen = view.get(r.address)
            if seen is not None and seen.healthy:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router never saw {r.address} healthy")
            if self._stopping.is_set() or r.state == "draining":
                raise RuntimeError("stopped while starting")
            time.sleep(0.2)

    def _ready_or_stop(self, ref, timeout_s: float) -> bool:
        """Whether ``ref`` is ready within ``timeout_s`` (None: wait that long, not ready);
        raises once the controller stops."""
        if ref is None:
            self._stopping.wait(timeout_s)
            ready: list = []
        else:
            ready, _ = ray.wait([ref], timeout=timeout_s)
        if self._stopping.is_set():
            raise RuntimeError("stopped while waiting for resources")
        return bool(ready)

    def _tail(self, host, key: str) -> str:
        try:
            return ray.get(host.stderr_tail.remote(key), timeout=5)
        except Exception:  # noqa: BLE001 - the host may be gone
            return ""

    def _stop_replica(self, r: Replica) -> None:
        """Out of the router (its requests fail over, if any), then its processes and resources."""
        self._deregister(r)
        self._teardown_many([r])

    def _drop(self, r: Replica) -> None:
        """Forget a stopped replica (lock held)."""
        if r in self.replicas:
            self.replicas.remove(r)

    def _teardown_many(self, replicas: list[Replica]) -> None:
        """Stop every rank (SIGTERM, then SIGKILL), kill the replicas' own hosts, free the
        placement groups."""
        by_host: dict[Any, list[str]] = {}
        for r in replicas:
            for host, key in r.hosts:
                by_host.setdefault(host, []).append(key)
        refs = [host.stop.remote(keys, 10.0) for host, keys in by_host.items()]
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=20)
            except Exception:  # noqa: BLE001
                pass
        for r in replicas:
            for host, _ in r.hosts if r.own_hosts else ():
                try:
                    ray.kill(host)
                except Exception:  # noqa: BLE001
                    pass
            r.hosts, r.own_hosts = [], False
            if r.pg is not None:
                try:
                    remove_placement_group(r.pg)
                except Exception:  # noqa: BLE001
                    pass
                r.pg = None
