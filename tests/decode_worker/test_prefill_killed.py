"""A prefill worker that never delivers (no Submit, or kill -9 mid-prefill): the decode
worker's lease (--kv-lease-s 2) fails the stream with UNAVAILABLE, frees the reserved blocks
and keeps serving with a fresh prefill worker.
"""
from __future__ import annotations

import time

import grpc
import pytest

from engine.config import SamplingParams
from tests.workers.harness import (
    collect,
    generate,
    greedy,
    open_generate,
    pool_flags,
    prompts_for,
    submit,
    wait_idle,
    wait_until,
)

LEASE_S = 2.0
MARGIN_S = 3.0


@pytest.fixture(scope="module")
def decode(spawn_module, tiny_dir):
    return spawn_module("decode", tiny_dir, *pool_flags(), "--kv-lease-s", str(LEASE_S))


def spawn_prefill(spawn, tiny_dir, *flags):
    return spawn("prefill", tiny_dir, *pool_flags(), "--kv-lease-s", str(LEASE_S), *flags)


def check_serves(prefill, decode, reference) -> None:
    [prompt] = prompts_for([30], seed=9000)
    [expected] = reference([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    result = generate(prefill, decode, "after-failure", prompt, greedy(10))
    assert result.error is None, result.error
    assert result.token_ids == expected.token_ids
    wait_idle(prefill, decode)


def expect_lease_failure(call, since: float) -> None:
    result = collect(call)
    elapsed_s = time.monotonic() - since
    assert result.token_ids == []
    assert result.error is not None and result.error.code() == grpc.StatusCode.UNAVAILABLE, result.error
    assert "lease expired" in result.error.details()
    assert elapsed_s < LEASE_S + MARGIN_S, f"the stream ended {elapsed_s:.1f} s after the last sign of life"


def test_submit_never_sent(spawn, tiny_dir, decode, reference):
    prefill = spawn_prefill(spawn, tiny_dir)
    [prompt] = prompts_for([50], seed=9100)
    call = open_generate(decode, prefill.grpc, "never-submitted", prompt, greedy(8))
    wait_until(lambda: decode.stats().num_transferring == 1, 10, "the decode worker to reserve blocks")
    reserved_at = time.monotonic()
    assert decode.stats().kv_blocks_used == 4    # 50 prompt tokens + 1, 16 per block
    expect_lease_failure(call, reserved_at)
    wait_idle(decode, timeout_s=2.0)
    assert decode.stats().num_transferring == 0
    check_serves(prefill, decode, reference)   # the prefill worker that never got the Submit


def test_prefill_killed_mid_prefill(spawn, tiny_dir, decode, reference):
    # One prompt token per step: the 240-token prompt is still in prefill when P dies, after
    # its sender opened the request (heartbeats) towards the decode worker.
    prefill = spawn_prefill(spawn, tiny_dir, "--chunked-prefill-size", "1")
    [prompt] = prompts_for([240], seed=9200)
    call = open_generate(decode, prefill.grpc, "prefill-killed", prompt, greedy(8))
    submit(prefill, decode.grpc, "prefill-killed", prompt, greedy(8))
    wait_until(lambda: decode.stats().num_transferring == 1, 10, "the decode worker to reserve blocks")
    wait_until(lambda: prefill.stats().num_running == 1, 10, "the prompt to be in prefill", interval_s=0.005)
    prefill.kill()
    killed_at = time.monotonic()
    assert prefill.proc.returncode == -9
    assert decode.stats().num_transferring == 1
    expect_lease_failure(call, killed_at)
    wait_idle(decode, timeout_s=2.0)
    check_serves(spawn_prefill(spawn, tiny_dir), decode, reference)   # a freshly started one


def test_request_id_reused_while_its_blocks_wait_for_the_lease(spawn, tiny_dir, decode, reference):
    """Nothing listens at the prefill address: the decode worker keeps the reservation (the
    router may move it to another prefill worker). The client then cancels: with no known writer
    the blocks wait out the lease. Reusing the request_id in that window is refused (it used to
    kill the decode worker's engine thread)."""
    [prompt] = prompts_for([20], seed=9300)
    nobody = "127.0.0.1:1"
    call = open_generate(decode, nobody, "reused", prompt, greedy(4))
    wait_until(lambda: decode.stats().num_transferring == 1, 10, "the reservation")
    call.cancel()
    again = collect(open_generate(decode, nobody, "reused", prompt, greedy(4), timeout_s=10))
    assert again.error.code() == grpc.StatusCode.ALREADY_EXISTS, again.error
    assert "request_id='reused' is still being cleaned up here" in again.error.details()
    assert decode.stats().kv_blocks_used == 2       # the engine thread is alive and answers
    wait_idle(decode, timeout_s=LEASE_S + MARGIN_S)
    prefill = spawn_prefill(spawn, tiny_dir)
    [expected] = reference([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    result = generate(prefill, decode, "reused", prompt, greedy(4))   # free again once cleaned up
    assert result.error is None, result.error
    assert result.token_ids == expected.token_ids
    wait_idle(prefill, decode)
