"""Start a worker process: flags -> configs -> engine -> engine thread -> gRPC + /metrics.

Used by ``python -m prefill_worker`` and ``python -m decode_worker``. When every server is up
it prints one line ``TANDEM_WORKER_READY {json}`` with the bound addresses (ports may be 0 =
picked), then serves until SIGINT/SIGTERM and shuts everything down.

With ``--tensor-parallel-size N``, ``--tp-rank 0`` is that worker (it serves only once every
rank joined and loaded its shard) and ``--tp-rank r > 0`` is a follower: no gRPC, it runs rank
0's steps and its own side of kvtransfer (the role's ``follow``), prints the same READY line
with ``"grpc": null`` once joined, and exits on SIGTERM/SIGINT, on rank 0's stop, or (code 1)
when rank 0 goes away.

Every rank needs the deployment's cluster secret from the environment (``TANDEM_CLUSTER_SECRET``
or ``TANDEM_CLUSTER_SECRET_FILE``, see protos/auth.py) and exits 2 without it: rank 0's gRPC
refuses calls that do not carry it, and kvtransfer's CurveZMQ keys derive from it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.cli_args import add_config_args, config_from_args
from engine.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from protos.auth import require_secret
from protos.process import freeze_heap
from worker.config import NOT_FLAGS, WorkerConfig

logger = logging.getLogger(__name__)
READY_PREFIX = "TANDEM_WORKER_READY "


@dataclass
class WorkerParts:
    """What a role hands back to be served: its loop, gRPC registration and stats."""

    loop: Any                                   # an EngineLoop
    register: list[Callable]                    # add_XServicer_to_server partials
    service_names: list[str]
    metrics: Any                                # WorkerMetrics
    close: Callable[[], None]
    tensor_parallel_size: int = 1
    on_cpu: bool = True                         # the engine runs on CPU (its threads may be bound)
    # Run on the engine thread, with its torch threads, before the worker says it is ready
    # (LLMEngine.tune_kernels: load-time choices timed on the thread that will step).
    prepare: Callable[[], None] | None = None


def parse_args(role: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {role}_worker",
                                     description=f"Tandem {role} worker: engine + gRPC + kvtransfer + /metrics")
    parser.add_argument("--log-level", default="INFO")
    add_config_args(parser, WorkerConfig, skip=NOT_FLAGS)
    add_config_args(parser, ModelConfig)
    add_config_args(parser, CacheConfig)
    add_config_args(parser, SchedulerConfig)
    add_config_args(parser, ParallelConfig)
    return parser.parse_args(argv)


def run(role: str, build: Callable[..., WorkerParts], argv: list[str] | None = None,
        follow: Callable[..., Any] | None = None) -> int:
    """``build(worker, model, cache, scheduler, parallel)`` makes rank 0's parts;
    ``follow(worker, runner)`` makes a follower rank's RoleHandler."""
    # Until the asyncio loop takes over, SIGTERM unwinds like Ctrl-C so a half-built engine
    # still drops its /dev/shm pool (KVPool unlinks it when released).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    args = parse_args(role, argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s", stream=sys.stderr)
    try:
        worker = config_from_args(WorkerConfig, args, cluster_secret=require_secret(f"the {role} worker"))
        configs = (config_from_args(ModelConfig, args), config_from_args(CacheConfig, args),
                   config_from_args(SchedulerConfig, args))
        parallel = config_from_args(ParallelConfig, args)
        import torch
        if not parallel.is_leader:   # a follower steps on this thread
            if worker.num_threads:
                torch.set_num_threads(worker.num_threads)
            return _follow(role, worker, configs, parallel, follow)
        # Only the engine thread may own an OpenMP team (worker/loop.py): build on one.
        num_threads = worker.num_threads or torch.get_num_threads()
        torch.set_num_threads(1)
        parts = build(worker, *configs, parallel)
        parts.loop.num_threads = num_threads
        parts.loop.bind_threads = worker.bind_threads and parts.on_cpu
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"{role} worker: error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(role, worker, parts))
    finally:
        parts.close()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _follow(role: str, worker: WorkerConfig, configs: tuple[ModelConfig, CacheConfig, SchedulerConfig],
            parallel: ParallelConfig, follow: Callable[..., Any] | None) -> int:
    from engine.tp.follower import run_follower

    def ready() -> None:
        line = {"role": role, "tp_rank": parallel.tp_rank, "tensor_parallel_size": parallel.tensor_parallel_size,
                "pid": os.getpid(), "grpc": None, "metrics": None}
        freeze_heap()
        print(READY_PREFIX + json.dumps(line), flush=True)

    make_handler = None if follow is None else (lambda runner: follow(worker, runner))
    return run_follower(*configs, parallel, make_handler, on_ready=ready)


async def _serve(role: str, worker: WorkerConfig, parts: WorkerParts) -> int:
    from worker.grpc_server import start_server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics_port = parts.metrics.serve(worker.host, worker.metrics_port) if worker.metrics_port >= 0 else None
    parts.loop.start()
    if parts.prepare is not None:
        await parts.loop.run(parts.prepare)
    try:
        server, port, health_servicer = await start_server(worker.host, worker.port, parts.register,
                                                           parts.service_names, worker.cluster_secret)
    except OSError as exc:
        print(f"{role} worker: error: {exc}", file=sys.stderr)
        parts.loop.stop()
        return 2
    ready = {"role": role, "grpc": f"{worker.host}:{port}", "pid": os.getpid(),
             "metrics": None if metrics_port is None else f"{worker.host}:{metrics_port}",
             "tp_rank": 0, "tensor_parallel_size": parts.tensor_parallel_size}
    freeze_heap()
    print(READY_PREFIX + json.dumps(ready), flush=True)
    logger.info("%s worker serving gRPC on %s", role, ready["grpc"])
    code = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.5)
        except asyncio.TimeoutError:
            if not parts.loop.alive:  # the engine thread died: stop answering SERVING, exit
                logger.error("%s engine thread died (%r); exiting so the worker can be restarted",
                             role, parts.loop.error)
                await health_servicer.enter_graceful_shutdown()
                code = 1
                break
    logger.info("%s worker shutting down", role)
    await server.stop(grace=2.0)
    parts.loop.stop()
    parts.metrics.close()
    return code
