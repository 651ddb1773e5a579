"""A tensor-parallel follower (rank > 0): joins rank 0's group, loads its shard, and runs every
step rank 0 broadcasts until rank 0 says stop or goes away.

Runs as its own process, one per rank > 0: spawned by `LLM` as ``python -m engine.tp.follower``,
or started by a launcher as ``python -m prefill_worker|decode_worker --tp-rank r`` (the roles
plug in their :class:`FollowerHooks`, worker/tp_role.py's ``RoleHandler``, for their side of
kvtransfer). It schedules nothing: rank 0's messages say which tokens run (``STEP``) and which
role operations to mirror (``OPS``).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from engine.cli_args import add_config_args, config_from_args
from engine.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.model_runner import ModelRunner, StepInputs
from engine.tp.group import OPS, PING, STEP, STOP

logger = logging.getLogger(__name__)


class FollowerHooks:
    """What a follower rank does beside rank 0's steps. The base is the `LLM` follower's: forward
    only, no role state. A worker role's (worker/tp_role.py, ``RoleHandler``) adds its side of
    kvtransfer: a hook after each layer and the ops rank 0 mirrors."""

    def after_layer(self, extra: dict[str, Any]) -> Callable[[int], None] | None:
        """The hook for one step's forward, from the ``extra`` rank 0 sent with the step."""
        return None

    def apply_wire(self, wire: Any) -> list[int]:
        """Apply rank 0's ops (in their wire form, as sent with ``OPS``); return this rank's reply."""
        if wire:
            raise ValueError(f"this rank has no role to apply ops {wire!r:.80}")
        return []

    def close(self) -> None:
        """Called once the rank stops."""


class Follower:
    def __init__(self, runner: ModelRunner, handler: FollowerHooks | None = None) -> None:
        if runner.group is None or runner.group.is_leader:
            raise ValueError("a follower needs a runner of TP rank > 0")
        self.runner = runner
        self.handler = handler or FollowerHooks()

    def run(self) -> None:
        """Serve rank 0 until it sends STOP; raises when rank 0 is gone or silent too long."""
        group = self.runner.group
        assert group is not None   # checked in __init__
        while True:
            kind, body = group.receive()
            if kind == PING:
                continue
            if kind == STOP:
                logger.info("rank 0 said stop")
                return
            if kind == STEP:
                self.runner.execute_step(StepInputs.from_wire(body["inputs"]),
                                         self.handler.after_layer(body["extra"]))
            elif kind == OPS:
                reply = self.handler.apply_wire(body["ops"])
                if body["reply"]:
                    group.all_min(reply)
            else:
                raise ValueError(f"unknown TP message kind {kind}")


def run_follower(model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel: ParallelConfig, make_handler: Callable[[ModelRunner], FollowerHooks] | None = None,
                 on_ready: Callable[[], None] | None = None) -> int:
    """Build this rank's runner, serve until STOP (0), SIGTERM/SIGINT (0), or failure (1)."""
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGINT, _stop_on_signal)
    runner = None
    handler = None
    try:
        runner = ModelRunner(model_config, cache_config, scheduler_config.chunked_prefill_size, parallel)
        handler = make_handler(runner) if make_handler is not None else FollowerHooks()
        if on_ready is not None:
            on_ready()
        Follower(runner, handler).run()
        return 0
    except _Stop:
        logger.info("TP rank %d stopping on a signal", parallel.tp_rank)
        return 0
    except ValueError as exc:  # bad configuration: same exit code as a worker's flag errors
        logger.error("TP rank %d: %s", parallel.tp_rank, exc)
        return 2
    except Exception:  # noqa: BLE001 - rank 0 gone, a collective failed, or a role op failed
        logger.exception("TP rank %d failed; exiting", parallel.tp_rank)
        return 1
    finally:
        # Signals from here on would interrupt the cleanup that drops the /dev/shm pool.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if handler is not None:
            handler.close()
        if runner is not None:
            runner.close()


class _Stop(BaseException):
    """SIGTERM/SIGINT: unwind and clean up (a follower has no other way to be told)."""


def _stop_on_signal(signum: int, frame: object) -> None:
    """Unwind to run_follower's clean-up, which exits 0 (a worker's _exit_on_signal exits 128 + signum)."""
    raise _Stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.tp.follower",
                                     description="Tandem tensor-parallel follower rank (spawned by LLM)")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--num-threads", type=int, default=0, help="torch CPU threads; 0 keeps torch's default")
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig):
        add_config_args(parser, cls)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s tp-follower %(name)s: %(message)s", stream=sys.stderr)
    if args.num_threads:
        import torch
        torch.set_num_threads(args.num_threads)
    try:
        configs = [config_from_args(cls, args) for cls in (ModelConfig, CacheConfig, SchedulerConfig,
                                                            ParallelConfig)]
    except ValueError as exc:
        print(f"tp follower: error: {exc}", file=sys.stderr)
        return 2
    return run_follower(*configs)


if __name__ == "__main__":
    sys.exit(main())
