"""Every worker RPC needs the deployment's cluster secret: without it UNAUTHENTICATED, with a
wrong one PERMISSION_DENIED, and the call does nothing (no request admitted, none aborted).
Health stays open; a worker with no secret in its environment does not start."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.launch import WorkerProcess, WorkerStartError
from protos.auth import METADATA_KEY, SECRET_ENV, SECRET_FILE_ENV
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.workers.harness import greedy, pool_flags, prompts_for, submit

PROMPT = prompts_for([12], seed=9700)[0]
WRONG = ((METADATA_KEY, "not-the-cluster-secret-at-all"),)


def _calls(role: str, channel: grpc.Channel) -> dict:
    """Each RPC of the role, as a function of the metadata to send."""
    if role == "prefill":
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        return {
            "Session": lambda md: list(stub.Session(iter([worker_pb2.PrefillSessionRequest(submit=[
                worker_pb2.SubmitRequest(request_id="intruder", prompt_token_ids=PROMPT, sampling=greedy(2),
                                         decode_address="127.0.0.1:1")], abort=["victim"])]),
                metadata=md, timeout=10)),
            "SetDestination": lambda md: stub.SetDestination(worker_pb2.SetDestinationRequest(
                request_id="victim", block_ids=[0], region_descriptor=b"x"), metadata=md, timeout=10),
            "Abort": lambda md: stub.Abort(worker_pb2.AbortRequest(request_id="victim"), metadata=md, timeout=10),
            "Stats": lambda md: stub.Stats(worker_pb2.StatsRequest(), metadata=md, timeout=10),
        }
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    return {
        "Session": lambda md: list(stub.Session(iter([worker_pb2.DecodeSessionRequest(generate=[
            worker_pb2.GenerateRequest(request_id="intruder", prompt_token_ids=PROMPT, sampling=greedy(2),
                                       prefill_address="127.0.0.1:1")], abort=["victim"])]),
            metadata=md, timeout=10)),
        "SetPrefill": lambda md: stub.SetPrefill(worker_pb2.SetPrefillRequest(
            request_id="victim", prefill_address="127.0.0.1:1"), metadata=md, timeout=10),
        "Abort": lambda md: stub.Abort(worker_pb2.AbortRequest(request_id="victim"), metadata=md, timeout=10),
        "Stats": lambda md: stub.Stats(worker_pb2.StatsRequest(), metadata=md, timeout=10),
    }


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_rpcs_without_the_cluster_secret_are_refused(spawn, tiny_dir, role):
    worker = spawn(role, tiny_dir, *pool_flags())
    # A channel of its own: the harness's channel adds the secret to every call.
    with grpc.insecure_channel(worker.grpc) as channel:
        for name, call in _calls(role, channel).items():
            for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED), (WRONG, grpc.StatusCode.PERMISSION_DENIED)):
                with pytest.raises(grpc.RpcError, match="cluster secret") as err:
                    call(metadata)
                assert err.value.code() == code, f"{role} {name} with metadata {metadata}"
                assert "cluster secret" in err.value.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING      # no secret needed
    stats = worker.stats()                                # the harness sends the secret: it answers
    assert stats.role == role and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_preallocated == 0 and stats.kv_blocks_used == 0


def test_a_prefill_worker_with_the_secret_accepts_requests(spawn, tiny_dir):
    worker = spawn("prefill", tiny_dir, *pool_flags())
    reply = submit(worker, "127.0.0.1:1", "with-secret", PROMPT, greedy(2))
    assert reply.num_cached_tokens == 0


@pytest.mark.parametrize("env", [{SECRET_ENV: ""}, {SECRET_ENV: "short"}])
def test_a_worker_without_a_usable_secret_does_not_start(tiny_dir, env):
    with pytest.raises(WorkerStartError, match="exit code 2") as err:
        WorkerProcess("prefill", ["--model", str(tiny_dir), "--device", "cpu", "--port", "0"],
                      env={**env, SECRET_FILE_ENV: ""}, start_timeout_s=60, stderr_tail=20)
    assert "exit code 2" in str(err.value) and "cluster secret" in str(err.value)
