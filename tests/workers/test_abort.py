"""Cancellation at every stage of a request frees its blocks on both workers at once.

A request is stopped while the prefill worker is still computing its prompt (chunked into
many small steps), while the decode worker's reservation waits for KV that never comes, and
while it decodes (client cancel, and an explicit DecodeWorker.Abort). Each time both workers'
kv_blocks_used must come back to 0 well before any lease could have freed them, and a fresh
request must still give the colocated reference's tokens.
"""
from __future__ import annotations

import time

import grpc
import pytest

from engine.config import SamplingParams
from protos.tandem.v1 import worker_pb2
from tests.metrics import metric, scrape
from tests.workers.harness import (
    collect,
    generate,
    greedy,
    open_generate,
    pool_flags,
    prompts_for,
    start_pair,
    submit,
    wait_idle,
    wait_until,
)

LEASE_S = 30          # the backstop; every test here must free blocks far sooner
FREED_WITHIN_S = 5.0
PREFILL_CHUNK = 1     # tokens per prefill step: a 240-token prompt takes 240 steps
LOG_INTERVAL_S = 0.1  # the decode worker adds to tandem_generation_tokens_total this often
LONG_MAX_TOKENS = 240  # with a 12-token prompt, all the tiny model's 256 positions


@pytest.fixture(scope="module")
def pair(spawn_module, tiny_dir):
    flags = [*pool_flags(), "--kv-lease-s", str(LEASE_S), "--log-interval-s", str(LOG_INTERVAL_S)]
    return start_pair(spawn_module, tiny_dir, *flags, prefill_flags=("--chunked-prefill-size", str(PREFILL_CHUNK)))


def counter_total(worker, name: str) -> float:
    return metric(scrape(worker.metrics), name)


def prompt_tokens_total(prefill) -> float:
    return counter_total(prefill, "tandem_prompt_tokens_total")


def settled_generation_tokens(decode) -> float:
    """The decode worker's tokens generated so far, once its counter stopped moving (it is
    brought up to date every LOG_INTERVAL_S)."""
    last = counter_total(decode, "tandem_generation_tokens_total")
    while True:
        time.sleep(3 * LOG_INTERVAL_S)
        now = counter_total(decode, "tandem_generation_tokens_total")
        if now == last:
            return now
        last = now


def check_fresh_request(prefill, decode, reference, request_id: str) -> None:
    [prompt] = prompts_for([21], seed=7000)
    [expected] = reference([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    result = generate(prefill, decode, request_id, prompt, greedy(8))
    assert result.error is None, result.error
    assert result.token_ids == expected.token_ids
    wait_idle(prefill, decode)


def test_abort_during_prefill(pair, reference):
    prefill, decode = pair
    wait_idle(prefill, decode)
    [prompt] = prompts_for([240], seed=7100)
    before = prompt_tokens_total(prefill)
    call = open_generate(decode, prefill.grpc, "abort-prefill", prompt, greedy(8))
    submit(prefill, decode.grpc, "abort-prefill", prompt, greedy(8))
    # Running at the prefill worker means its prompt is still being computed (a computed
    # prompt leaves the running batch at once: the prefill worker samples only one token).
    wait_until(lambda: prefill.stats().num_running == 1, 10, "the prompt to be in prefill", interval_s=0.005)
    prefill.prefill_stub.Abort(worker_pb2.AbortRequest(request_id="abort-prefill"), timeout=10)
    call.cancel()
    result = collect(call)
    assert result.error is not None and result.error.code() == grpc.StatusCode.CANCELLED
    assert result.token_ids == []
    started = time.monotonic()
    wait_idle(prefill, decode, timeout_s=FREED_WITHIN_S)
    assert time.monotonic() - started < FREED_WITHIN_S
    computed = prompt_tokens_total(prefill) - before
    assert 0 < computed < len(prompt), "the abort must land while the prompt is half computed"
    assert prefill.stats().num_running == 0 and decode.stats().num_transferring == 0
    check_fresh_request(prefill, decode, reference, "after-abort-prefill")


def test_cancel_while_decode_waits_for_kv(pair, reference):
    """No Submit is ever sent: the decode worker's reservation waits for KV; cancel it."""
    prefill, decode = pair
    wait_idle(prefill, decode)
    [prompt] = prompts_for([40], seed=7200)
    call = open_generate(decode, prefill.grpc, "abort-transfer", prompt, greedy(8))
    wait_until(lambda: decode.stats().num_transferring == 1, 10, "the decode worker to reserve blocks")
    assert decode.stats().kv_blocks_used == 3   # 40 prompt tokens + the first token, 16 per block
    call.cancel()
    assert collect(call).error.code() == grpc.StatusCode.CANCELLED
    wait_idle(decode, timeout_s=FREED_WITHIN_S)
    assert decode.stats().num_transferring == 0
    # The decode worker also told the prefill worker to forget the destination it sent.
    time.sleep(1.0)
    with pytest.raises(grpc.RpcError, match="request_id='abort-transfer' is not known here") as err:
        prefill.prefill_stub.Abort(worker_pb2.AbortRequest(request_id="abort-transfer"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    check_fresh_request(prefill, decode, reference, "after-abort-transfer")


def test_cancel_during_decode(pair, reference):
    """The cancel must stop generation: without it the request would run to LONG_MAX_TOKENS."""
    prefill, decode = pair
    wait_idle(prefill, decode)
    generated_before = settled_generation_tokens(decode)
    [prompt] = prompts_for([12], seed=7300)
    call = open_generate(decode, prefill.grpc, "cancel-decode", prompt, greedy(LONG_MAX_TOKENS))
    submit(prefill, decode.grpc, "cancel-decode", prompt, greedy(LONG_MAX_TOKENS))
    tokens = []
    for response in call:
        tokens += response.token_ids
        if len(tokens) >= 3:
            break
    in_use = decode.stats()   # asked after tokens arrived: the request holds its blocks now
    assert in_use.num_running == 1 and in_use.kv_blocks_used > 0, in_use
    call.cancel()
    wait_idle(prefill, decode, timeout_s=FREED_WITHIN_S)
    assert decode.stats().num_running == 0
    generated = settled_generation_tokens(decode) - generated_before
    assert len(tokens) <= generated < LONG_MAX_TOKENS, "generation must stop at the cancel, not run to max_tokens"
    [expected] = reference([prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert tokens[:3] == expected.token_ids
    check_fresh_request(prefill, decode, reference, "after-cancel-decode")


def test_explicit_decode_abort_ends_the_stream(pair, reference):
    prefill, decode = pair
    wait_idle(prefill, decode)
    [prompt] = prompts_for([12], seed=7400)
    call = open_generate(decode, prefill.grpc, "abort-decode", prompt, greedy(200))
    submit(prefill, decode.grpc, "abort-decode", prompt, greedy(200))
    responses = []
    for response in call:
        responses.append(response)
        if sum(len(r.token_ids) for r in responses) >= 3:
            decode.decode_stub.Abort(worker_pb2.AbortRequest(request_id="abort-decode"), timeout=10)
            break
    responses += list(call)   # the rest of the stream: ends normally, with an "abort" finish
    final = responses[-1]
    assert final.finish_reason == "abort"
    num_tokens = sum(len(r.token_ids) for r in responses)
    assert 3 <= final.num_output_tokens == num_tokens < 200
    assert final.num_prompt_tokens == len(prompt)
    wait_idle(prefill, decode, timeout_s=FREED_WITHIN_S)
    with pytest.raises(grpc.RpcError, match="request_id='abort-decode' is not known here") as err:   # gone
        decode.decode_stub.Abort(worker_pb2.AbortRequest(request_id="abort-decode"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    check_fresh_request(prefill, decode, reference, "after-abort-decode")


def test_an_abort_that_overtakes_its_submit_makes_the_submit_fail_and_computes_nothing(pair, tiny_dir):
    """The router sends Submit and, on a quick client disconnect or a refused destination, Abort
    concurrently; when the Abort lands first the Submit must not start a prompt nobody reads."""
    prefill, decode = pair
    [prompt] = prompts_for([40], seed=9100)
    before = prompt_tokens_total(prefill)
    with pytest.raises(grpc.RpcError) as aborted:
        prefill.prefill_stub.Abort(worker_pb2.AbortRequest(request_id="overtaken-0"), timeout=10)
    assert aborted.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as refused:
        submit(prefill, decode.grpc, "overtaken-0", prompt, greedy(4))
    assert refused.value.code() == grpc.StatusCode.ABORTED
    assert "aborted before its Submit arrived" in refused.value.details()
    assert prefill.stats().kv_blocks_used == 0
    assert prompt_tokens_total(prefill) == before
    result = generate(prefill, decode, "overtaken-1", prompt, greedy(4))     # a fresh id still runs
    assert result.error is None and len(result.token_ids) == 4
    wait_idle(prefill, decode)
