"""Tensor-parallel worker replicas: a TP=2 prefill worker + a TP=2 decode worker (four real
processes, gloo between the ranks of a replica) give the colocated `LLM`'s greedy tokens.

The tiny Llama has 2 KV heads, so each rank holds one: prefill rank r writes its head of every
prompt into decode rank r's /dev/shm pool, and decode rank 0 starts a request only once both
ranks' KV landed. A missing rank-to-rank write leaves a head of zeros and changes the tokens.
Also: READY lines of follower ranks, a TP-size mismatch refused with both sizes named, and a
killed rank taking its replica down instead of hanging.
"""
from __future__ import annotations

import time

import grpc
import pytest

from engine.config import SamplingParams
from engine.tp.group import free_local_port
from protos.tandem.v1 import worker_pb2
from tests.workers.harness import (
    RPC_TIMEOUT_S,
    START_TIMEOUT_S,
    check_greedy_matches_colocated,
    check_logprobs_match,
    generate,
    greedy,
    pool_flags,
    prompts_for,
    wait_idle,
)

LENGTHS = [3, 90, 17, 33, 64, 48]
MAX_TOKENS = [5, 12, 9, 8, 10, 6]


def _replica(spawn, tiny_dir, role: str, *flags: str, name: str) -> list:
    """Start both ranks of a TP=2 replica together; return them once all are ready."""
    address = f"127.0.0.1:{free_local_port()}"
    ranks = [spawn(role, tiny_dir, *pool_flags(), "--tensor-parallel-size", "2", "--tp-rank", str(rank),
                   "--dist-init-address", address, *flags, name=f"{name}-rank{rank}", wait=False)
             for rank in (1, 0)][::-1]
    for worker in ranks:
        worker.wait_ready(START_TIMEOUT_S)
    return ranks


@pytest.fixture(scope="module")
def tp_pair(spawn_module, tiny_dir):
    flags = ["--kv-backend", "shm", "--log-interval-s", "1"]
    prefill = _replica(spawn_module, tiny_dir, "prefill", *flags, name="prefill-tp")
    decode = _replica(spawn_module, tiny_dir, "decode", *flags, name="decode-tp")
    yield prefill, decode
    wait_idle(prefill[0], decode[0])


def test_follower_ranks_report_ready_without_grpc(tp_pair):
    prefill, decode = tp_pair
    for (leader, follower), role in ((prefill, "prefill"), (decode, "decode")):
        assert follower.info == {"role": role, "tp_rank": 1, "tensor_parallel_size": 2, "pid": follower.pid,
                                 "grpc": None, "metrics": None}
        assert leader.info["tp_rank"] == 0 and leader.info["tensor_parallel_size"] == 2 and leader.info["grpc"]
        assert follower.shm_files() and leader.shm_files()   # each rank has a pool of its own heads


def test_tp2_workers_match_colocated_greedy(tp_pair, reference):
    (prefill, _), (decode, _) = tp_pair
    check_greedy_matches_colocated(prefill, decode, reference, LENGTHS, MAX_TOKENS, seed=7000, tag="tp-greedy")


def test_tp2_workers_logprobs_match_colocated(tp_pair, reference):
    (prefill, _), (decode, _) = tp_pair
    [prompt] = prompts_for([29], seed=7100)
    [ref] = reference([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2))
    result = generate(prefill, decode, "tp-logprobs", prompt, greedy(5, logprobs=2))
    assert result.error is None, result.error
    assert result.token_ids == ref.token_ids
    assert len(result.logprobs) == 5
    check_logprobs_match(result, ref, num_top=2)


def test_tp_size_mismatch_fails_the_request_naming_both_sizes(tp_pair, spawn, tiny_dir):
    (prefill, _), _ = tp_pair
    # A short lease: a cancelled one-sided reservation is freed when the lease runs out.
    decode_tp1 = spawn("decode", tiny_dir, *pool_flags(), "--kv-backend", "shm", "--kv-lease-s", "2",
                       name="decode-tp1")
    [prompt] = prompts_for([20], seed=7200)
    result = generate(prefill, decode_tp1, "tp-mismatch", prompt, greedy(4))
    assert result.error is not None
    details = result.error.details()
    # The model handshake (engine/fingerprint.py) refuses the pair before any transfer,
    # naming both sides' TP rank/size.
    assert "FAILED_PRECONDITION" in details and "model fingerprints differ in" in details and "tp" in details
    assert "tp=0/1" in details and "tp=0/2" in details, details
    # What a router does when a stream fails: abort at the prefill worker (which may have dropped
    # the request itself already), which frees the prompt.
    try:
        prefill.prefill_stub.Abort(worker_pb2.AbortRequest(request_id="tp-mismatch"), timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
    wait_idle(prefill, decode_tp1)


def _wait_exit(worker, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = worker.proc.poll()
        if code is not None:
            return code
        time.sleep(0.1)
    return None


def test_a_killed_rank_takes_its_replica_down(spawn, tiny_dir):
    """kill -9 of a follower: rank 0 stops serving and exits 1. kill -9 of rank 0: its
    follower leaves (non-zero) within the group timeout instead of waiting forever."""
    prefill = _replica(spawn, tiny_dir, "prefill", name="prefill-kill")
    decode = _replica(spawn, tiny_dir, "decode", name="decode-kill")
    prefill[1].kill()
    decode[0].kill()
    started = time.monotonic()
    assert _wait_exit(prefill[0], 40) == 1, "prefill rank 0 kept running without its follower"
    assert _wait_exit(decode[1], 40) not in (None, 0), "decode rank 1 kept running without rank 0"
    assert time.monotonic() - started < 40
    assert "engine thread died" in prefill[0].stderr()
    assert prefill[0].shm_files() == [] and decode[1].shm_files() == []   # each cleaned up its own pool
