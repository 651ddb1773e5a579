"""Spawn the follower ranks of a local TP replica (`LLM(..., tensor_parallel_size=N)`).

Runs in the process that will be rank 0. Followers are ``python -m engine.tp.follower``
children given the same configs as flags; they join the group at a free local port picked
here. ``stop`` waits for them to leave (after rank 0's STOP) and kills stragglers, removing the
/dev/shm pool a killed child cannot unlink itself.
"""
from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import replace

import torch

from engine.cli_args import config_to_args
from engine.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.tp.group import free_local_port
from tandem_shm.pools import remove_pools_of

logger = logging.getLogger(__name__)


class LocalFollowers:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 tensor_parallel_size: int, host: str = "127.0.0.1") -> None:
        """Start ranks 1..N-1; ``parallel`` is rank 0's config to build the engine with."""
        address = f"{host}:{free_local_port(host)}"
        self.parallel = ParallelConfig(tensor_parallel_size, 0, address)
        self.procs: list[subprocess.Popen] = []
        flags = [*config_to_args(model_config), *config_to_args(cache_config), *config_to_args(scheduler_config),
                 "--num-threads", str(torch.get_num_threads()),
                 "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
        try:
            for rank in range(1, tensor_parallel_size):
                rank_flags = config_to_args(replace(self.parallel, tp_rank=rank))
                self.procs.append(subprocess.Popen([sys.executable, "-m", "engine.tp.follower", *flags, *rank_flags],
                                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        except BaseException:
            self.stop(timeout_s=0)
            raise

    def dead(self) -> list[int]:
        """Exit codes of followers that are gone."""
        return [code for code in (p.poll() for p in self.procs) if code is not None]

    def stop(self, timeout_s: float = 10.0) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("TP follower pid %d did not exit; killing it", proc.pid)
                proc.kill()
                proc.wait()
            remove_pools_of(proc.pid)   # a follower killed here could not unlink its own
        self.procs = []

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]
