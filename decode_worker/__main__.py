"""Entry point: ``python -m decode_worker [flags]`` (see ``--help``)."""
from __future__ import annotations

import sys
from functools import partial

import kvtransfer
from decode_worker.servicer import DecodeServicer, PrefillClients
from decode_worker.worker import DecodeLoop
from engine.llm_engine import LLMEngine
from engine.serving.metrics import WorkerMetrics
from engine.serving.process import WorkerParts, run
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc


def build(worker, model_config, cache_config, scheduler_config) -> WorkerParts:
    engine = LLMEngine(model_config, cache_config, scheduler_config)
    pool = engine.runner.kv_pool
    receiver = kvtransfer.create_receiver(pool.tensor, kvtransfer.KVLayout.of_pool(pool.tensor), worker.kv_backend,
                                          shm_path=None if pool.shm_path is None else str(pool.shm_path),
                                          host=worker.host, lease_s=worker.kv_lease_s)
    metrics = WorkerMetrics("decode")
    prefill = PrefillClients()
    servicer = DecodeServicer(prefill)
    loop = DecodeLoop(engine, worker, metrics, receiver, servicer.send_destination)
    servicer.attach(loop)

    def close() -> None:
        receiver.close()
        engine.close()

    name = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
    return WorkerParts(loop, [partial(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, servicer)],
                       [name], metrics, close)


if __name__ == "__main__":
    sys.exit(run("decode", build))
