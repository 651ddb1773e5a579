"""Entry point: ``python -m decode_worker [flags]`` (see ``--help``).

``--tp-rank 0`` (the default) is the worker: engine, gRPC, its receiver; ``--tp-rank r > 0`` is
a follower rank of a tensor-parallel replica: it joins rank 0's group and registers its own KV
shard for the prefill worker's rank r to write into.
"""
from __future__ import annotations

import sys
from functools import partial

import kvtransfer
from decode_worker.ranks import DecodeRank
from decode_worker.servicer import DecodeServicer, PrefillClients
from decode_worker.worker import DecodeLoop
from engine.fingerprint import worker_fingerprint
from engine.kv_cache import KVPool
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc
from worker.metrics import WorkerMetrics
from worker.process import WorkerParts, run

DESCRIPTOR_KEY = "decode-kv-descriptor/{rank}"   # in the TP group's store: each rank's region


def _receiver(worker, pool: KVPool, rank: int) -> kvtransfer.Receiver:
    return kvtransfer.create_receiver(pool.tensor, kvtransfer.KVLayout.of_pool(pool.tensor, tp_rank=rank),
                                      worker.kv_backend, shm_path=None if pool.shm_path is None else str(pool.shm_path),
                                      host=worker.host, lease_s=worker.kv_lease_s,
                                      secret=worker.cluster_secret or None)


def build(worker, model_config, cache_config, scheduler_config, parallel_config) -> WorkerParts:
    engine = LLMEngine(model_config, cache_config, scheduler_config, parallel_config=parallel_config)
    try:
        receiver = _receiver(worker, engine.kv_pool, 0)
        descriptor = receiver.descriptor.to_bytes()
        group = engine.tp_group
        if group is not None:   # followers publish their regions once registered
            store = group.store
            assert store is not None   # open until the group is closed
            descriptor = kvtransfer.join_descriptors(
                [descriptor, *(bytes(store.get(DESCRIPTOR_KEY.format(rank=r))) for r in range(1, group.size))])
    except BaseException:
        engine.close()
        raise
    metrics = WorkerMetrics("decode")
    prefill = PrefillClients(worker.cluster_secret)
    servicer = DecodeServicer(prefill, fingerprint=str(worker_fingerprint(engine)))
    loop = DecodeLoop(engine, worker, metrics, receiver, servicer.send_destination, descriptor,
                      deliver=servicer.deliver)
    servicer.attach(loop)

    def close() -> None:
        receiver.close()
        engine.close()

    name = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
    return WorkerParts(loop, [partial(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, servicer)],
                       [name], metrics, close, parallel_config.tensor_parallel_size, prepare=engine.tune_kernels,
                       on_cpu=engine.on_cpu)


def follow(worker, runner: ModelRunner) -> DecodeRank:
    """A follower rank's receiver, announced to rank 0 through the group's store."""
    group, pool = runner.group, runner.kv_pool
    assert group is not None and group.store is not None and pool is not None   # a follower's, built
    receiver = _receiver(worker, pool, group.rank)
    # torch's stub says str; the store takes bytes as they are.
    group.store.set(DESCRIPTOR_KEY.format(rank=group.rank), receiver.descriptor.to_bytes())  # type: ignore[arg-type]
    return DecodeRank(receiver)


if __name__ == "__main__":
    sys.exit(run("decode", build, follow=follow))
