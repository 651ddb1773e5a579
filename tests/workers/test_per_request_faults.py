"""Workers survive any one request: a bad destination, a first token outside the vocabulary or a
transfer that never completes fails that request alone -- a clean gRPC status, its blocks freed --
and the worker goes on serving. Real worker processes; a test-controlled prefill side
(``RoguePrefill``) plays a faulty or hostile prefill worker against the real decode worker.
"""
from __future__ import annotations

import grpc
import pytest

from engine.config import SamplingParams
from protos.tandem.v1 import worker_pb2
from tests.models import VOCAB_SIZE
from tests.workers.harness import (
    POOL_BLOCKS,
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
from tests.workers.rogue_prefill import RoguePrefill

PROMPT = prompts_for([20], seed=9700)[0]   # 20 tokens fill 2 blocks of 16


@pytest.fixture(scope="module")
def expected(reference) -> list[int]:
    [out] = reference([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return out.token_ids


@pytest.fixture(scope="module")
def pair(spawn_module, tiny_dir):
    return start_pair(spawn_module, tiny_dir, *pool_flags(), decode_flags=("--kv-lease-s", "3"))


@pytest.fixture
def rogue():
    peer = RoguePrefill()
    yield peer
    peer.close()


def still_serves(prefill, decode, expected: list[int], tag: str) -> None:
    """Both workers answer a normal request correctly and hold no blocks afterwards."""
    result = generate(prefill, decode, f"good-after-{tag}", PROMPT, greedy(6))
    assert result.error is None and result.submit_error is None, (result.error, result.submit_error)
    assert result.token_ids == expected
    wait_idle(prefill, decode)


def real_destination(decode, rogue: RoguePrefill, request_id: str):
    """A genuine descriptor of the decode worker's pool (the request started on it reserved blocks for us)."""
    call = open_generate(decode, rogue.address, request_id, PROMPT, greedy(6), timeout_s=30)
    return call, rogue.destination(request_id)


def expect_invalid(fn, *words: str) -> None:
    with pytest.raises(grpc.RpcError, match="status = StatusCode.INVALID_ARGUMENT\n") as err:
        fn()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    for word in words:
        assert word in err.value.details(), err.value.details()


@pytest.mark.parametrize("block_ids, words", [
    ([POOL_BLOCKS + 5, 1], ["destination block ids", f"out of range [0, {POOL_BLOCKS})"]),
    ([3, 3], ["destination block ids", "duplicate"]),
], ids=["out-of-range", "duplicate"])
def test_set_destination_with_bad_block_ids_is_refused_and_the_prefill_worker_keeps_serving(
        pair, rogue, expected, block_ids, words):
    prefill, decode = pair
    call, dest = real_destination(decode, rogue, "probe")
    stub = prefill.prefill_stub
    fingerprint = decode.stats().fingerprint   # the model handshake passes; the block ids do not
    # Early (before its Submit): the Submit is refused and nothing is computed for it.
    stub.SetDestination(worker_pb2.SetDestinationRequest(request_id="bad-early", block_ids=block_ids,
                                                         region_descriptor=dest.descriptor, fingerprint=fingerprint),
                        timeout=10)
    expect_invalid(lambda: submit(prefill, decode.grpc, "bad-early", PROMPT, greedy(4)), *words)
    # Late (after its Submit): the destination is refused, the request can still be aborted.
    submit(prefill, decode.grpc, "bad-late", PROMPT, greedy(4))
    expect_invalid(lambda: stub.SetDestination(worker_pb2.SetDestinationRequest(
        request_id="bad-late", block_ids=block_ids, region_descriptor=dest.descriptor, fingerprint=fingerprint),
        timeout=10), *words)
    stub.Abort(worker_pb2.AbortRequest(request_id="bad-late"), timeout=10)
    call.cancel()
    still_serves(prefill, decode, expected, "bad-destination")


@pytest.mark.parametrize("first_token_id", [VOCAB_SIZE, VOCAB_SIZE + 1000], ids=["at-vocab", "beyond-vocab"])
def test_notify_with_a_first_token_outside_the_vocab_fails_that_request_and_frees_its_blocks(
        pair, rogue, expected, first_token_id):
    import kvtransfer

    prefill, decode = pair
    call, _ = real_destination(decode, rogue, "bad-first-token")
    sender, dest = rogue.writer("bad-first-token")
    layers = list(range(kvtransfer.RegionDescriptor.from_bytes(dest.descriptor).layout.num_layers))
    sender.write("bad-first-token", layers, dest.block_ids, dest.block_ids).result(10)
    sender.notify("bad-first-token", kvtransfer.NotifyPayload(first_token_id=first_token_id,
                                                              num_prompt_tokens=len(PROMPT))).result(10)
    result = collect(call)
    assert result.error is not None and not result.token_ids
    assert "outside the vocabulary" in result.error.details(), result.error.details()
    wait_idle(decode)
    still_serves(prefill, decode, expected, "bad-first-token")


def test_a_transfer_whose_writer_stops_fails_at_the_lease_and_frees_its_blocks(pair, rogue, expected):
    """The writer wrote one layer and then went quiet (no heartbeat): the decode worker fails the
    request when its lease (3 s here) runs out, frees the blocks and keeps serving."""
    import kvtransfer

    prefill, decode = pair
    call, _ = real_destination(decode, rogue, "stalled")
    sender, dest = rogue.writer("stalled")
    sender.write("stalled", [0], dest.block_ids, dest.block_ids).result(10)
    sender.close()   # gone: no more writes, no heartbeats
    result = collect(call)
    assert result.error is not None and "lease expired" in result.error.details(), result.error
    wait_until(lambda: decode.stats().kv_blocks_used == 0, 10, "the stalled request's blocks to be freed")
    assert isinstance(kvtransfer.RegionDescriptor.from_bytes(dest.descriptor).num_blocks, int)
    still_serves(prefill, decode, expected, "stalled")
