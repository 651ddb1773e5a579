"""Entry point: ``python -m prefill_worker [flags]`` (see ``--help``)."""
from __future__ import annotations

import sys
from functools import partial

from engine.llm_engine import LLMEngine
from engine.serving.metrics import WorkerMetrics
from engine.serving.process import WorkerParts, run
from prefill_worker.servicer import PrefillServicer
from prefill_worker.worker import PrefillLoop
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc


def build(worker, model_config, cache_config, scheduler_config) -> WorkerParts:
    engine = LLMEngine(model_config, cache_config, scheduler_config, keep_finished_blocks=True)
    metrics = WorkerMetrics("prefill")
    loop = PrefillLoop(engine, worker, metrics)
    servicer = PrefillServicer(loop)

    def close() -> None:
        loop.close()
        engine.close()

    name = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
    return WorkerParts(loop, [partial(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, servicer)],
                       [name], metrics, close)


if __name__ == "__main__":
    sys.exit(run("prefill", build))
