"""``tandem serve | status | scale | down``: the user's side of the Ray orchestration.

Runs in the user's shell process. ``serve`` checks what it can before touching Ray (model,
TP sizes, ports, memory), connects to the Ray cluster (or starts a local one), starts the
controller actor (deploy/controller.py) and waits until every worker is serving. The other
commands find the controller by name on the cluster at ``--address`` (default: the running one).

``serve`` makes the deployment's cluster secret (or takes the operator's from
``TANDEM_CLUSTER_SECRET`` / ``TANDEM_CLUSTER_SECRET_FILE``) and hands it to the controller, which
gives it to the router and workers in their environment; it is never printed. On a one-node
Ray cluster the workers' internal endpoints bind 127.0.0.1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deploy.prometheus_sd import DEFAULT_SD_FILE
from engine.cli_args import add_config_args, config_from_args, config_to_args
from engine.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    cpu_has_amx_bf16,
    resolve_dtype,
)
from engine.hf_hub import is_hub_id
from engine.sim.arch import sim_profile_of
from protos.auth import load_secret, new_secret
from protos.limits import ROLES
from router.config import DECODE_POLICIES, PREFILL_POLICIES, RouterConfig, add_public_api_args, public_api_flags
from tandem_shm.pools import SHM_DIR
from worker.config import WorkerConfig

logger = logging.getLogger(__name__)
# WorkerConfig flags `serve` passes on to workers; the controller sets the others (host, ports).
WORKER_KNOBS = ("kv_backend", "kv_nixl_allow_public", "kv_lease_s", "log_interval_s", "num_threads", "bind_threads")
_NOT_WORKER_KNOBS = tuple(f.name for f in dataclasses.fields(WorkerConfig) if f.name not in WORKER_KNOBS)
READY_POLL_S = 0.5
# Conditional disaggregation on a one-node CPU deployment (benchmarks/vs_vllm.py, 2 cores, SmolLM2,
# 1P1D): prompts up to this length prefilled by the decode worker on all cores gave c16 398 vs 312,
# c64 536 vs 380, 1024-token prompts 79 vs 60, 2048-token prompts 32 vs 25 output tok/s against P/D.
CPU_LOCAL_PREFILL_MAX_TOKENS = 4096


class ServeError(ValueError):
    """A startup check failed or the deployment could not come up (printed, exit 2)."""


# -- parsers ---------------------------------------------------------------------------------


def _address_arg(p: argparse.ArgumentParser, serve: bool) -> None:
    p.add_argument("--address", default=None,
                   help="Ray cluster: 'auto' (the running one), 'local' (start a new local one, "
                        "dashboard off) or host:port; default: the running one"
                        + (", else a new local one" if serve else ""))


def _node_list(text: str) -> list[str]:
    nodes = [n.strip() for n in text.split(",") if n.strip()]
    if not nodes:
        raise argparse.ArgumentTypeError("give node addresses or hostnames, comma-separated")
    return nodes


def add_parsers(sub: argparse._SubParsersAction) -> None:
    d = RouterConfig()
    p = sub.add_parser("serve", help="serve a model: router + prefill and decode workers on Ray",
                       description="Start the router and the prefill/decode workers on a Ray cluster (or a new "
                                   "local one) and print the HTTP and gRPC addresses once every worker is ready. "
                                   "Ctrl-C (or `tandem down`) stops everything it started.")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill worker replicas (default 1)")
    p.add_argument("--decode", type=int, default=1, metavar="N", help="decode worker replicas (default 1)")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=None, metavar="N",
                   help="TP ranks per replica, both roles (default 1)")
    p.add_argument("--prefill-tp", type=int, default=None, metavar="N", help="TP ranks per prefill replica")
    p.add_argument("--decode-tp", type=int, default=None, metavar="N", help="TP ranks per decode replica")
    p.add_argument("--host", default=d.host, help=f"address the router's HTTP and gRPC servers bind "
                                                  f"(default {d.host}; 0.0.0.0 for every interface)")
    p.add_argument("--http-port", type=int, default=d.http_port, help=f"router HTTP port (default {d.http_port})")
    p.add_argument("--grpc-port", type=int, default=d.grpc_port, help=f"router gRPC port (default {d.grpc_port})")
    _address_arg(p, serve=True)
    p.add_argument("--detach", action="store_true",
                   help="return once serving and leave the deployment running (stop it with `tandem down`)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY", ""), help="or TANDEM_API_KEY")
    p.add_argument("--served-model-name", default="", help="name clients use (default: --model)")
    p.add_argument("--prefill-policy", default=d.prefill_policy, choices=PREFILL_POLICIES)
    p.add_argument("--decode-policy", default=d.decode_policy, choices=DECODE_POLICIES)
    add_public_api_args(p)
    p.add_argument("--local-prefill-max-tokens", type=int, default=None, metavar="N",
                   help="conditional disaggregation: prompts of at most N tokens are prefilled by their decode "
                        f"worker itself, with no prefill worker or KV transfer; 0: never (default: "
                        f"{CPU_LOCAL_PREFILL_MAX_TOKENS} on a one-node CPU-only deployment, where decode then runs "
                        "on all of the cores, else 0)")
    p.add_argument("--drain-move-after-s", type=float, default=None, metavar="S",
                   help="a decode worker scaled down (by `tandem scale` or the planner) moves the streams it still "
                        "runs S seconds into its drain to other workers, which prefill their prompt and output "
                        "again (a recompute), so the scale-down takes effect then; default: they finish there")
    p.add_argument("--cpus-per-worker", type=float, default=0.1,
                   help="Ray CPU demand per worker rank on CPU-only clusters (default 0.1, so router + 2 "
                        "workers fit on 2 cores); GPU clusters reserve 1 GPU + 1 CPU per rank")
    p.add_argument("--prefill-nice", type=int, default=5, choices=range(0, 20), metavar="0-19",
                   help="niceness of prefill workers on CPU-only clusters (default 5): where they share cores "
                        "with decode workers, a decode step (on the critical path of every running stream) "
                        "goes first and prefill takes the rest")
    p.add_argument("--prefill-threads", type=int, default=0, metavar="N",
                   help="torch threads per prefill rank on CPU-only clusters (default 0: the node's cores shared "
                        "by its prefill ranks; prefill is niced below decode and runs on what decode leaves)")
    p.add_argument("--decode-threads", type=int, default=0, metavar="N",
                   help="torch threads per decode rank on CPU-only clusters (default 0: the node's cores / its "
                        "worker ranks, or / its decode ranks while local prefill is on)")
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="give up on a worker not ready by then")
    p.add_argument("--prefill-nodes", type=_node_list, default=[], metavar="ADDR[,ADDR...]",
                   help="run prefill replicas only on these Ray nodes (node IP addresses or hostnames; default: any)")
    p.add_argument("--decode-nodes", type=_node_list, default=[], metavar="ADDR[,ADDR...]",
                   help="run decode replicas only on these Ray nodes (default: any)")
    p.add_argument("--router-node", type=_node_list, default=[], metavar="ADDR",
                   help="run the router on this Ray node (default: the node `tandem serve` runs on, where the "
                        "controller runs); the router must then listen where the controller reaches it "
                        "(--host 0.0.0.0 or that node's address)")
    p.add_argument("--prometheus-sd-file", default=DEFAULT_SD_FILE, metavar="PATH",
                   help="Prometheus file_sd target list (router and every worker's /metrics) the controller "
                        f"keeps current on this node, for deploy/prometheus/prometheus.yml (default "
                        f"{DEFAULT_SD_FILE}; '' for none)")
    _planner_args(p)
    p.add_argument("--log-level", default="INFO")
    add_config_args(p, ModelConfig)
    add_config_args(p, CacheConfig)
    add_config_args(p, SchedulerConfig)
    add_config_args(p, WorkerConfig, skip=_NOT_WORKER_KNOBS)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("status", help="the deployment's router and workers (role, address, load, KV usage)")
    _address_arg(p, serve=False)
    p.add_argument("--json", action="store_true", help='one object {"router": {...}, "workers": [...]}')
    p.set_defaults(func=cmd_status, log_level="WARNING")

    p = sub.add_parser("scale", help="set the number of prefill or decode replicas, live",
                       description="Add replicas (they take traffic once registered and healthy) or drain and "
                                   "remove them (no new requests; in-flight ones finish first).")
    p.add_argument("role", choices=ROLES)
    p.add_argument("replicas", type=int)
    _address_arg(p, serve=False)
    p.add_argument("--no-wait", action="store_true", help="return at once instead of when the change is done")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.set_defaults(func=cmd_scale, log_level="WARNING")

    p = sub.add_parser("down", help="stop the deployment (and the Ray cluster `tandem serve --detach` started)")
    _address_arg(p, serve=False)
    p.set_defaults(func=cmd_down, log_level="WARNING")


def _planner_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SLO planner", "set the prefill and decode replicas from the load and the latency "
                             "SLOs (README 'Planner'); --prefill / --decode are the starting counts")
    g.add_argument("--planner", action="store_true",
                   help="run the planner: every interval it reads the router's and workers' /metrics and sets the "
                        "replicas per role (live scaling, as `tandem scale`); needs --ttft-slo-ms and --itl-slo-ms")
    g.add_argument("--ttft-slo-ms", type=float, default=None, metavar="MS",
                   help="time-to-first-token SLO, on the router's p90 over an interval")
    g.add_argument("--itl-slo-ms", type=float, default=None, metavar="MS",
                   help="inter-token latency SLO, on the router's mean over an interval")
    g.add_argument("--max-workers", type=int, default=8, metavar="N",
                   help="the most prefill + decode replicas the planner may run (default 8); each role keeps >= 1")
    g.add_argument("--planner-interval-s", type=float, default=5.0, metavar="S",
                   help="seconds between the planner's decisions (default 5); it grows a role after 2 intervals "
                        "in a row asked for it, shrinks one after 6, and leaves a role alone 3 intervals after "
                        "each change")
    g.add_argument("--planner-dry-run", action="store_true",
                   help="decide and log (and export tandem_planner_* metrics), change nothing")


def planner_config(args: argparse.Namespace) -> Any:
    """The PlannerConfig of ``--planner`` and its flags, else None; raises ServeError on a bad one."""
    from deploy.planner import PlannerConfig

    given = [f for f, v in (("--ttft-slo-ms", args.ttft_slo_ms), ("--itl-slo-ms", args.itl_slo_ms)) if v is not None]
    if not args.planner:
        if given or args.planner_dry_run:
            raise ServeError(f"{', '.join(given) or '--planner-dry-run'} without --planner: add --planner")
        return None
    if len(given) < 2:
        raise ServeError("--planner needs both --ttft-slo-ms and --itl-slo-ms")
    if args.prefill + args.decode > args.max_workers:
        raise ServeError(f"--prefill {args.prefill} + --decode {args.decode} is more than --max-workers "
                         f"{args.max_workers}: raise --max-workers or start with fewer")
    try:
        return PlannerConfig(ttft_slo_s=args.ttft_slo_ms / 1e3, itl_slo_s=args.itl_slo_ms / 1e3,
                             max_workers=args.max_workers, interval_s=args.planner_interval_s,
                             cooldown_s=3 * args.planner_interval_s, dry_run=args.planner_dry_run)
    except ValueError as exc:
        raise ServeError(str(exc)) from None


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The engine and worker knobs given to `serve` (those that differ from the defaults), as
    flags for every worker."""
    return [flag for cls, skip in ((ModelConfig, ("model",)), (CacheConfig, ()), (SchedulerConfig, ()),
                                   (WorkerConfig, _NOT_WORKER_KNOBS))
            for flag in config_to_args(config_from_args(cls, args), skip, changed_only=True)]


# -- startup checks --------------------------------------------------------------------------


def _tp_sizes(args: argparse.Namespace) -> dict[str, int]:
    both = args.tensor_parallel_size
    if both is not None and (args.prefill_tp is not None or args.decode_tp is not None):
        raise ServeError("give --tensor-parallel-size, or --prefill-tp / --decode-tp, not both")
    tp = {"prefill": args.prefill_tp or both or 1, "decode": args.decode_tp or both or 1}
    if min(tp.values()) < 1:
        raise ServeError(f"TP sizes must be >= 1, got {tp}")
    if tp["prefill"] != tp["decode"]:
        raise ServeError(f"--prefill-tp {tp['prefill']} and --decode-tp {tp['decode']} differ: KV blocks move "
                         "rank to rank, so both roles need the same TP size")
    return tp


def check_model(args: argparse.Namespace, tp: dict[str, int]) -> tuple[Any, Path]:
    """The model's architecture and local path (a hub id is resolved, or downloaded, here once
    for this node, before any worker starts); fails when a TP size does not divide its heads."""
    from engine.model_source import load_arch, resolve_model

    source = resolve_model(args.model, args.revision, args.download_dir)
    arch = load_arch(source)
    for role, size in tp.items():
        if arch.num_kv_heads % size or arch.num_heads % size:
            fits = [n for n in range(1, arch.num_kv_heads + 1)
                    if arch.num_kv_heads % n == 0 and arch.num_heads % n == 0]
            raise ServeError(f"{role} TP size {size} does not divide the model's {arch.num_kv_heads} KV heads and "
                             f"{arch.num_heads} attention heads: use --tensor-parallel-size "
                             f"{' or '.join(map(str, fits))}")
    return arch, source.path


def check_ports(host: str, ports: dict[str, int]) -> None:
    for flag, port in ports.items():
        if port <= 0:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                raise ServeError(f"port {port} on {host} is taken ({exc.strerror}): stop what uses it or pick "
                                 f"another with {flag}") from None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_cpu_memory(arch: Any, args: argparse.Namespace, tp: dict[str, int], num_workers: int,
                     model_path: Path | None = None) -> None:
    """On a one-node CPU cluster: every worker's weights and KV pool must fit this machine (a
    GGUF model's quantized blocks too, which workers keep beside the dense weights with
    --gguf-kernels auto)."""
    from deploy.plan import Workload, make_plan

    dtype = resolve_dtype(args.dtype, on_cuda=False)
    plan = make_plan(arch, args.model, dtype=dtype, block_size=args.block_size,
                     tensor_parallel_size=tp["decode"], workload=Workload(1024, 256), memory_bytes=None,
                     gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
                     max_model_len=args.max_model_len, chunked_prefill_size=args.chunked_prefill_size,
                     max_num_seqs=args.max_num_seqs)
    if plan.num_blocks * plan.block_size < plan.max_model_len:
        per_token = plan.kv_bytes_per_token
        raise ServeError(f"the KV pool holds {plan.kv_tokens} tokens ({plan.kv_budget_bytes / 2**30:.2f} GiB at "
                         f"{per_token} bytes per token), less than one max_model_len={plan.max_model_len} sequence: "
                         f"lower --max-model-len or raise --kv-cache-memory to at least "
                         f"{per_token * plan.max_model_len / 2**30:.2f} GiB")
    kv = args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
    blocks = 0
    if model_path is not None and model_path.suffix == ".gguf" and args.gguf_kernels == "auto" and tp["decode"] == 1:
        from engine.gguf_file import GGUFFile
        blocks = GGUFFile(model_path).kernel_block_bytes()
    # bf16 on AMX: the workers' linears may keep their row-major weights beside oneDNN's packed
    # ones for decode steps (engine/models/layers.py PackedLinear.rows), up to the weights again.
    rows = plan.weight_bytes_per_gpu if dtype == "bfloat16" and cpu_has_amx_bf16() else 0
    need = num_workers * (plan.weight_bytes_per_gpu + blocks + rows + kv)
    available = _mem_available()
    if available is not None and need > available:
        quantized = f" + {blocks / 2**30:.2f} GiB GGUF blocks" if blocks else ""
        quantized += f" + {rows / 2**30:.2f} GiB AMX row-major weights" if rows else ""
        raise ServeError(f"{num_workers} worker processes need {need / 2**30:.1f} GiB "
                         f"({plan.weight_bytes_per_gpu / 2**30:.2f} GiB weights{quantized} + {kv / 2**30:.2f} GiB "
                         f"KV pool each) but this machine has "
                         f"{available / 2**30:.1f} GiB available: use fewer replicas (--prefill/--decode), "
                         f"--dtype bfloat16, {'--gguf-kernels off, ' if blocks else ''}or a smaller --kv-cache-memory")
    shm = shutil.disk_usage(SHM_DIR).free if os.path.isdir(SHM_DIR) else None
    if args.shared_memory and shm is not None and num_workers * kv > shm:
        raise ServeError(f"{num_workers} KV pools of {kv / 2**30:.2f} GiB need "
                         f"{num_workers * kv / 2**30:.1f} GiB of /dev/shm, "
                         f"which has {shm / 2**30:.1f} GiB free: lower --kv-cache-memory or enlarge /dev/shm")


# -- Ray -------------------------------------------------------------------------------------


def connect(address: str | None, *, may_start: bool = False, detach: bool = False) -> str:
    """Connect this process to Ray; returns which cluster: ``"started"`` (a local cluster this
    started with ``ray start``, which ``tandem down`` then stops), ``"local"`` (one living in this
    process) or ``"joined"`` (one that was there). Call it before anything imports ray."""
    if address != "local" and "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").exists():
        # Ray turns token authentication on by itself for `auto`, not for an explicit address,
        # and reads the mode once, at import: do what `auto` does (clusters without auth ignore it).
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray

    from deploy.controller import NAMESPACE

    # Its notice on every connect is noise for `tandem status`.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    quiet: dict[str, Any] = {"namespace": NAMESPACE, "logging_level": logging.WARNING,
                             "log_to_driver": may_start and not detach}
    if address != "local":
        try:
            ray.init(address=address or "auto", **quiet)
            return "joined"
        except ConnectionError as exc:
            if address is not None or not may_start:
                raise ServeError(f"no Ray cluster at {address or 'auto'} ({exc}): nothing is serving here; "
                                 "start with `tandem serve`") from None
    # No idle Ray worker prestarted for this driver: Tandem's actors start their own, and an idle
    # one wakes 100 times a second on the cores the engine uses (deploy/controller.py, ProcessHost).
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    if not detach:
        ray.init(address="local", include_dashboard=False, **quiet)   # lives as long as this process
        return "local"
    # Token authentication (Ray >= 2.52): without the token in ~/.ray/auth_token, which `ray start`
    # makes on first use and which never appears on a command line, nothing can join or use the
    # cluster; the deployment's secrets travel in actor arguments, so reaching Ray is owning it.
    os.environ["RAY_AUTH_MODE"] = "token"
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    if not (Path.home() / ".ray" / "auth_token").exists():
        made = subprocess.run([ray_bin, "get-auth-token", "--generate"], capture_output=True, text=True)  # prints it
        if made.returncode != 0:
            raise ServeError(f"`ray get-auth-token --generate` failed:\n{made.stderr}")
        (Path.home() / ".ray" / "auth_token").chmod(0o600)     # Ray writes it readable by all
    done = subprocess.run([ray_bin, "start", "--head", "--include-dashboard=false", "--disable-usage-stats"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ServeError(f"`ray start --head` failed:\n{done.stdout}{done.stderr}")
    from ray._raylet import Config  # type: ignore[attr-defined]  # (compiled; no stub)
    Config.initialize("")        # this process imported ray before the mode was set: re-read it
    ray.init(address="auto", **quiet)
    return "started"


def _controller():
    import ray

    from deploy.controller import CONTROLLER_NAME, NAMESPACE

    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        raise ServeError("no Tandem deployment is running on this Ray cluster "
                         "(start one with `tandem serve`)") from None


def check_node_sets(node_sets: dict[str, list[str]], nodes: list[dict], router_host: str) -> None:
    """Every --prefill-nodes / --decode-nodes / --router-node entry names an alive Ray node, and a
    router placed away from the controller listens beyond loopback."""
    from deploy.controller import matching_nodes

    known = ", ".join(f"{n['NodeManagerAddress']} ({n['NodeManagerHostname']})" for n in nodes if n["Alive"])
    for role, selectors in node_sets.items():
        for selector in selectors:
            if not matching_nodes([selector], nodes):
                raise ServeError(f"--{role}-node{'' if role == 'router' else 's'}: no alive Ray node is {selector!r}; "
                                 f"the cluster has {known}")
    if len(node_sets.get("router", [])) > 1:
        raise ServeError("--router-node takes one node")
    if node_sets.get("router") and router_host.startswith("127."):
        raise ServeError(f"--router-node with --host {router_host}: the controller, on this node, could not reach "
                         "the router; give --host 0.0.0.0 (with --api-key) or the router node's address")


def local_prefill_max_tokens(flag: int | None, use_gpu: bool, num_nodes: int) -> int:
    """``--local-prefill-max-tokens``, else its default: CPU_LOCAL_PREFILL_MAX_TOKENS on one CPU-only
    node (prefill and decode share the same cores, so moving the KV between them buys nothing and
    the decode worker's own chunked prefill beside its batch wins), else 0 (P/D for every prompt)."""
    if flag is not None:
        return flag
    return CPU_LOCAL_PREFILL_MAX_TOKENS if not use_gpu and num_nodes == 1 else 0


def internal_host(num_nodes: int) -> str:
    """Where workers bind their internal endpoints: loopback when the whole deployment is on one
    node (nothing else needs to reach them), else "" (each node's own address)."""
    return "127.0.0.1" if num_nodes == 1 else ""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    tp = _tp_sizes(args)
    # --engine sim --sim-profile F and --model sim:F are one model, sim:F (engine/sim/arch.py), for
    # the workers, the router's tokenizer and model check alike.
    args.model = config_from_args(ModelConfig, args).model
    if args.prefill < 1 or args.decode < 1:
        raise ServeError(f"--prefill and --decode must be >= 1, got {args.prefill} and {args.decode}")
    if args.drain_move_after_s is not None and not args.drain_move_after_s >= 0:
        raise ServeError(f"--drain-move-after-s must be >= 0, got {args.drain_move_after_s}")
    arch, model_path = check_model(args, tp)
    check_ports(args.host, {"--http-port": args.http_port, "--grpc-port": args.grpc_port})
    knobs = worker_flags(args)             # builds, and so checks, every engine config before Ray starts
    args.planner_config = planner_config(args)

    cluster = connect(args.address, may_start=True, detach=args.detach)
    import ray

    # Ctrl-C and SIGTERM (`kill`, a supervisor) both stop what serve started, in order; also when
    # it was launched with SIGINT ignored (a background job of a non-interactive shell). Set
    # after ray.init, which installs handlers of its own.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _serve(args, tp, arch, model_path, knobs, cluster)
    finally:
        ray.shutdown()


def _serve(args: argparse.Namespace, tp: dict[str, int], arch: Any, model_path: Path, knobs: list[str],
           cluster: str) -> int:
    import ray

    from deploy.controller import CONTROLLER_NAME, NAMESPACE, Controller, ServeSpec, remote_error

    try:
        ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        pass                                          # none: good
    else:
        raise ServeError("a Tandem deployment is already running on this Ray cluster: see `tandem status`, "
                         "stop it with `tandem down`")
    simulated = sim_profile_of(args.model) is not None   # no weights, no GPU, a pool of a few MB
    use_gpu = not simulated and args.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
    alive_nodes = [n for n in ray.nodes() if n["Alive"]]
    node_sets = {"router": args.router_node, "prefill": args.prefill_nodes, "decode": args.decode_nodes}
    check_node_sets(node_sets, alive_nodes, args.host)
    local_prefill = local_prefill_max_tokens(args.local_prefill_max_tokens, use_gpu, len(alive_nodes))
    if not use_gpu and len(alive_nodes) == 1 and not simulated:
        check_cpu_memory(arch, args, tp, args.prefill * tp["prefill"] + args.decode * tp["decode"], model_path)
    router_flags = ["--host", args.host, "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port),
                    "--prefill-policy", args.prefill_policy, "--decode-policy", args.decode_policy,
                    "--local-prefill-max-tokens", str(local_prefill),
                    *public_api_flags(args)]
    if args.drain_move_after_s is not None:
        router_flags += ["--drain-move-after-s", str(args.drain_move_after_s)]
    if args.load_format != "auto":
        router_flags += ["--load-format", args.load_format]   # the router checks workers against the config alone
    if is_hub_id(args.model) and not Path(args.model).exists():
        # The router runs on this node: it reads the snapshot check_model resolved (the last
        # --model wins) and answers to the id.
        router_flags += ["--model", str(model_path), "--served-model-name", args.served_model_name or args.model]
    elif args.served_model_name:
        router_flags += ["--served-model-name", args.served_model_name]
    spec = ServeSpec(model=args.model, replicas={"prefill": args.prefill, "decode": args.decode}, tp=tp,
                     worker_flags=knobs, router_flags=router_flags,
                     api_key=args.api_key, router_node_id=ray.get_runtime_context().get_node_id(),
                     node_sets={role: nodes for role, nodes in node_sets.items() if nodes},
                     use_gpu=use_gpu, cpus_per_rank=args.cpus_per_worker, started_ray=cluster == "started",
                     fixed_cluster=cluster != "joined",
                     start_timeout_s=args.start_timeout_s, cluster_secret=load_secret() or new_secret(),
                     internal_host=internal_host(len(alive_nodes)), prefill_nice=args.prefill_nice,
                     threads={"prefill": args.prefill_threads, "decode": args.decode_threads},
                     local_prefill=local_prefill > 0,
                     prometheus_sd_file=os.path.abspath(args.prometheus_sd_file) if args.prometheus_sd_file else "",
                     planner=args.planner_config)
    controller = Controller.options(  # type: ignore[attr-defined]  # a Ray actor class
        name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=16,
        scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
            spec.router_node_id, soft=False)).remote(spec)
    try:
        router = ray.get(controller.start.remote())
        print(f"router: HTTP http://{router['http']}/v1  gRPC {router['grpc']}; starting "
              f"{args.prefill} prefill + {args.decode} decode workers (TP {tp['decode']}) ...", flush=True)
        status = _wait_settled(controller, args.start_timeout_s)
    except BaseException as exc:
        _stop(controller)
        if cluster == "started":
            _ray_stop()
        if isinstance(exc, (ServeError, KeyboardInterrupt)):
            raise
        raise ServeError(remote_error(exc, ("RuntimeError", "ValueError"))) from None
    print(f"Tandem is serving {spec.model} on {len(status['workers'])} workers\n"
          f"  OpenAI HTTP: http://{router['http']}/v1\n  gRPC:        {router['grpc']}\n"
          f"  Ray cluster: {ray.get_runtime_context().gcs_address}", flush=True)
    if args.detach:
        print("detached: `tandem status` shows the workers, `tandem down` stops them", flush=True)
        return 0
    print("Ctrl-C stops it", flush=True)
    try:
        while True:
            time.sleep(1.0)
            try:
                ray.get(controller.status.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                print("the deployment was stopped (tandem down)", flush=True)
                return 0
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
        _stop(controller)
        print("stopped", flush=True)
        return 0


def _stop(controller) -> None:
    import ray

    try:
        ray.get(controller.shutdown.remote(), timeout=120)
    except Exception as exc:  # noqa: BLE001 - kill it anyway
        logger.warning("controller shutdown: %s", exc)
    ray.kill(controller)


def _ray_stop() -> None:
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "stop"], capture_output=True)


def _wait_settled(controller, timeout_s: float, role: str | None = None, count: int | None = None) -> dict:
    """Until every desired replica is running and nothing drains; fails on a failed replica."""
    import ray

    deadline = time.monotonic() + timeout_s
    last_note = time.monotonic()
    while True:
        status = ray.get(controller.status.remote())
        workers = status["workers"]
        failed = [w for w in workers if w["state"] in ("failed", "crashloop")]
        if failed:
            raise ServeError("; ".join(f"{w['id']} {'failed' if w['state'] == 'failed' else 'keeps dying'}: "
                                       f"{w['error']}" for w in failed))
        counts = {r: sum(w["role"] == r for w in workers) for r in ROLES}
        if all(w["state"] == "running" for w in workers) and counts == status["desired"]:
            return status
        if time.monotonic() > deadline:
            raise ServeError(f"not settled after {timeout_s:.0f} s: "
                             + ", ".join(f"{w['id']} {w['state']}" + (f" ({w['error']})" if w["error"] else "")
                                         for w in workers))
        if time.monotonic() - last_note > 15:
            last_note = time.monotonic()
            print("waiting: " + ", ".join(f"{w['id']} {w['state']}" for w in workers), flush=True)
        time.sleep(READY_POLL_S)


def render_status(status: dict) -> str:
    r = status["router"]
    lines = [f"model {status['model']}; router HTTP http://{r.get('http')}/v1, gRPC {r.get('grpc')} "
             f"(pid {r.get('pid')}, node {r.get('node')}, {r.get('state', 'running')}); desired {status['desired']}",
             f"{'ID':<11} {'ROLE':<8} {'STATE':<10} {'ADDRESS':<22} {'PID':>7} {'NODE':<15} {'RUN':>4} {'WAIT':>5} "
             f"{'KV':>6} {'REQS':>6} {'RESTARTS':>8}"]
    for w in status["workers"]:
        lines.append(f"{w['id']:<11} {w['role']:<8} {w['state']:<10} {w['address'] or '-':<22} {w['pid'] or '-':>7} "
                     f"{w['node'] or '-':<15} {w['num_running']:>4} {w['num_waiting']:>5} "
                     f"{100 * w['kv_usage']:>5.1f}% {w['num_requests']:>6} {w['restarts']:>8}")
    planner = status.get("planner") or {}
    if planner:
        last = planner.get("last") or {}
        dry = " (dry run)" if planner.get("dry_run") else ""
        lines.append(f"planner{dry}: TTFT SLO {planner['ttft_slo_ms']:g} ms, ITL SLO {planner['itl_slo_ms']:g} ms, "
                     f"max {planner['max_workers']} workers, /metrics "
                     f"{planner['metrics']}; last: {last.get('reasons', '-')} {last.get('note', '')}")
    if r.get("error"):
        lines.append(f"router: {r['error']}")
    for w in status["workers"]:
        if w["error"]:
            lines.append(f"{w['id']}: {w['error']}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    connect(args.address)
    import ray

    try:
        status = ray.get(_controller().status.remote())
    finally:
        ray.shutdown()
    print(json.dumps(status) if args.json else render_status(status))
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    connect(args.address)
    import ray

    from deploy.controller import remote_error

    try:
        controller = _controller()
        try:
            ray.get(controller.scale.remote(args.role, args.replicas))
        except ray.exceptions.RayTaskError as exc:
            raise ServeError(remote_error(exc, ("RuntimeError", "ValueError"))) from None
        if args.no_wait:
            print(f"{args.role} replicas set to {args.replicas}")
            return 0
        status = _wait_settled(controller, args.timeout_s)
    finally:
        ray.shutdown()
    print(render_status(status))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    connect(args.address)
    import ray

    try:
        controller = _controller()
        status = ray.get(controller.status.remote())
        _stop(controller)
    finally:
        ray.shutdown()
    if status.get("started_ray"):
        _ray_stop()
        print("stopped the deployment and the Ray cluster `tandem serve --detach` started")
    else:
        print("stopped the deployment")
    return 0
