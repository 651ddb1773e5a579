"""Entry point: ``python -m prefill_worker [flags]`` (see ``--help``).

``--tp-rank 0`` (the default) is the worker: engine, gRPC, its senders; ``--tp-rank r > 0`` is a
follower rank of a tensor-parallel replica: it computes its heads of every prompt and writes
them to the decode worker's rank r.
"""
from __future__ import annotations

import sys
from functools import partial

from engine.fingerprint import worker_fingerprint
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from prefill_worker.ranks import PrefillRank
from prefill_worker.servicer import PrefillServicer
from prefill_worker.worker import PrefillLoop
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc
from worker.metrics import WorkerMetrics
from worker.process import WorkerParts, run


def build(worker, model_config, cache_config, scheduler_config, parallel_config) -> WorkerParts:
    engine = LLMEngine(model_config, cache_config, scheduler_config, keep_finished_blocks=True,
                       parallel_config=parallel_config)
    metrics = WorkerMetrics("prefill")
    loop = PrefillLoop(engine, worker, metrics)
    servicer = PrefillServicer(loop, str(worker_fingerprint(engine)))

    def close() -> None:
        loop.close()
        engine.close()

    name = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
    return WorkerParts(loop, [partial(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, servicer)],
                       [name], metrics, close, parallel_config.tensor_parallel_size, prepare=engine.tune_kernels,
                       on_cpu=engine.on_cpu)


def follow(worker, runner: ModelRunner) -> PrefillRank:
    group, pool = runner.group, runner.kv_pool
    assert group is not None and pool is not None   # a follower's, built
    return PrefillRank(pool.tensor, group.rank, group.size, worker.kv_backend,
                       stall_s=worker.kv_lease_s, secret=worker.cluster_secret or None)


if __name__ == "__main__":
    sys.exit(run("prefill", build, follow=follow))
