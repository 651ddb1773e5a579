"""Bad requests get the right gRPC status and a message that says what is wrong; the workers
keep serving afterwards and hold no blocks for what they refused.
"""
from __future__ import annotations

import grpc
import pytest

from engine.config import SamplingParams
from protos.tandem.v1 import worker_pb2
from tests.models import VOCAB_SIZE
from tests.workers.harness import (
    generate,
    greedy,
    open_generate,
    prompts_for,
    submit,
    wait_idle,
    wait_until,
)

MAX_MODEL_LEN = 256  # the tiny checkpoint's max_position_embeddings
PROMPT = prompts_for([20], seed=9500)[0]

# (case id, request_id, prompt, sampling, words the message must contain)
BAD_REQUESTS = [
    ("empty-prompt", "bad", [], greedy(4), ["prompt_token_ids is empty"]),
    ("empty-request-id", "", PROMPT, greedy(4), ["request_id is empty"]),
    ("negative-temperature", "bad", PROMPT, worker_pb2.SamplingParams(temperature=-1.0),
     ["temperature must be >= 0", "-1"]),
    ("top-p-zero", "bad", PROMPT, worker_pb2.SamplingParams(top_p=0.0), ["top_p must be in (0, 1]", "got 0"]),
    ("logprobs-21", "bad", PROMPT, greedy(4, logprobs=21), ["logprobs must be in [0, 20]", "21"]),
    ("max-tokens-0", "bad", PROMPT, worker_pb2.SamplingParams(max_tokens=0), ["max_tokens must be >= 1", "0"]),
    ("token-id-at-vocab", "bad", PROMPT[:5] + [VOCAB_SIZE], greedy(4),
     [f"prompt token id {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})"]),
    ("negative-token-id", "bad", [-1] + PROMPT[:5], greedy(4), ["prompt token id -1 is outside the vocabulary"]),
    ("prompt-over-max-model-len", "bad", prompts_for([MAX_MODEL_LEN + 1], seed=9501)[0], greedy(4),
     [str(MAX_MODEL_LEN + 1), f"max_model_len={MAX_MODEL_LEN}"]),
]
CASE_IDS = [case[0] for case in BAD_REQUESTS]


@pytest.fixture(scope="module")
def pair(pd_pair, reference):
    [expected] = reference([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    prefill, decode = pd_pair
    yield prefill, decode
    # After everything below, both still serve a good request, and nothing leaked.
    result = generate(prefill, decode, "good-after-all", PROMPT, greedy(6))
    assert result.error is None, result.error
    assert result.token_ids == expected.token_ids
    wait_idle(prefill, decode)


def expect_status(code: grpc.StatusCode, words: list[str], fn) -> None:
    with pytest.raises(grpc.RpcError, match=f"status = {code}\n") as err:   # the call's str() names its status
        fn()
    assert err.value.code() == code, err.value
    for word in words:
        assert word in err.value.details()


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=CASE_IDS)
def test_generate_refuses(pair, case):
    prefill, decode = pair
    _, request_id, prompt, sampling, words = case
    call = open_generate(decode, prefill.grpc, request_id, prompt, sampling, timeout_s=10)
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, words, lambda: list(call))
    assert decode.stats().kv_blocks_used == 0


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=CASE_IDS)
def test_submit_refuses(pair, case):
    prefill, decode = pair
    _, request_id, prompt, sampling, words = case
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, words,
                  lambda: submit(prefill, decode.grpc, request_id, prompt, sampling))
    assert prefill.stats().kv_blocks_used == 0


def test_generate_without_prefill_address(pair):
    _, decode = pair
    call = open_generate(decode, "", "no-prefill", PROMPT, greedy(4), timeout_s=10)
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, ["prefill_address is empty"], lambda: list(call))


@pytest.mark.parametrize("field", ["request_id", "block_ids", "region_descriptor"])
def test_set_destination_needs_every_field(pair, field):
    prefill, _ = pair
    request = worker_pb2.SetDestinationRequest(request_id="dest", block_ids=[1, 2], region_descriptor=b"x")
    request.ClearField(field)
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, ["request_id, block_ids and region_descriptor are all required"],
                  lambda: prefill.prefill_stub.SetDestination(request, timeout=10))


def test_set_destination_refuses_negative_or_wrong_block_count_and_garbage(pair):
    prefill, decode = pair
    stub = prefill.prefill_stub
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, ["block_ids must be >= 0"], lambda: stub.SetDestination(
        worker_pb2.SetDestinationRequest(request_id="neg", block_ids=[-1, 2], region_descriptor=b"x"), timeout=10))
    submit(prefill, decode.grpc, "dest-known", PROMPT, greedy(4))   # 20 tokens fill 2 blocks
    fingerprint = decode.stats().fingerprint   # the model handshake passes; the destination does not
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, ["1 destination blocks for a prompt that fills 2"],
                  lambda: stub.SetDestination(worker_pb2.SetDestinationRequest(
                      request_id="dest-known", block_ids=[5], region_descriptor=b"x", fingerprint=fingerprint),
                      timeout=10))
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, ["descriptor"],
                  lambda: stub.SetDestination(worker_pb2.SetDestinationRequest(
                      request_id="dest-known", block_ids=[5, 6], region_descriptor=b"garbage", fingerprint=fingerprint),
                      timeout=10))
    stub.Abort(worker_pb2.AbortRequest(request_id="dest-known"), timeout=10)
    wait_idle(prefill)


def test_submit_refused_for_its_early_destination_leaves_nothing_behind(pair):
    """A destination may arrive before its Submit; if it is bad, the Submit is refused and
    the prefill worker must not go on computing (and holding blocks for) that request."""
    prefill, decode = pair
    stub = prefill.prefill_stub
    stub.SetDestination(worker_pb2.SetDestinationRequest(request_id="early-bad", block_ids=[5],
                                                         region_descriptor=b"garbage",
                                                         fingerprint=decode.stats().fingerprint), timeout=10)
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, ["1 destination blocks for a prompt that fills 2"],
                  lambda: submit(prefill, decode.grpc, "early-bad", PROMPT, greedy(4)))
    wait_idle(prefill, timeout_s=2.0)
    assert prefill.stats().num_running == prefill.stats().num_waiting == 0
    expect_status(grpc.StatusCode.NOT_FOUND, ["'early-bad' is not known here"],
                  lambda: stub.Abort(worker_pb2.AbortRequest(request_id="early-bad"), timeout=10))


def test_abort_unknown_request_is_not_found(pair):
    prefill, decode = pair
    for stub in (prefill.prefill_stub, decode.decode_stub):
        expect_status(grpc.StatusCode.NOT_FOUND, ["request_id='nobody' is not known here"],
                      lambda s=stub: s.Abort(worker_pb2.AbortRequest(request_id="nobody"), timeout=10))


def test_duplicate_request_id(pair):
    prefill, decode = pair
    # Decode: the first stream waits for KV (no Submit); a second one with its id is refused.
    first = open_generate(decode, prefill.grpc, "dup", PROMPT, greedy(4))
    wait_until(lambda: decode.stats().num_transferring == 1, 10, "the first request to reserve blocks")
    second = open_generate(decode, prefill.grpc, "dup", PROMPT, greedy(4), timeout_s=10)
    expect_status(grpc.StatusCode.ALREADY_EXISTS, ["request_id='dup' is already running here"],
                  lambda: list(second))
    assert decode.stats().num_transferring == 1   # the first one is untouched
    first.cancel()
    # Prefill: a second Submit of a queued id is refused.
    submit(prefill, decode.grpc, "dup-p", PROMPT, greedy(4))
    expect_status(grpc.StatusCode.ALREADY_EXISTS, ["request_id='dup-p' is already submitted"],
                  lambda: submit(prefill, decode.grpc, "dup-p", PROMPT, greedy(4)))
    prefill.prefill_stub.Abort(worker_pb2.AbortRequest(request_id="dup-p"), timeout=10)
    wait_idle(prefill, decode, timeout_s=5.0)
