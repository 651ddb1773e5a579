"""Model fingerprints between real workers (issue #13): a prefill and a decode worker of different
models refuse each other at the SetDestination handshake, naming both fingerprints, and free
what the request held; workers report their fingerprint in Stats."""
from __future__ import annotations

import grpc
import pytest

from engine.fingerprint import Fingerprint, ModelIdentity, model_identity
from tests.models import random_prompt
from tests.workers.harness import (
    BLOCK_SIZE,
    collect,
    generate,
    greedy,
    open_generate,
    pool_flags,
    start_pair,
    submit,
    wait_idle,
    wait_until,
)
from tests.workers.rogue_prefill import RoguePrefill

# A refused request's reserved decode blocks are freed when its lease ends (a writer that got the
# destination could still write into them until then); a short lease keeps the tests short.
LEASE_FLAGS = ["--kv-lease-s", "2"]


@pytest.fixture(scope="module")
def pair(spawn_module, tiny_model_dir):
    """A prefill worker of the tiny Llama and a decode worker of its tied-embedding sibling: the
    same KV layout (so blocks would land without complaint) but other weights."""
    return start_pair(spawn_module, tiny_model_dir("llama"), *pool_flags(), *LEASE_FLAGS,
                      decode_model=tiny_model_dir("llama_tied"), names=("prefill-llama", "decode-llama-tied"))


def test_workers_report_their_fingerprint_in_stats(pair, tiny_model_dir):
    prefill, decode = pair
    for worker, name in ((prefill, "llama"), (decode, "llama_tied")):
        reported = Fingerprint.parse(worker.stats().fingerprint)
        # 2 layers x 2 KV heads x head_dim 16, blocks of BLOCK_SIZE tokens, float32, TP rank 0 of 1.
        assert (reported.dtype, reported.kv, reported.tp) == ("float32", f"2x2x16/{BLOCK_SIZE}", "0/1")
        assert reported.model == model_identity(str(tiny_model_dir(name)))


def test_prefill_and_decode_of_different_models_refuse_each_other(pair):
    prefill, decode = pair
    prefill_fp, decode_fp = prefill.stats().fingerprint, decode.stats().fingerprint
    assert Fingerprint.parse(prefill_fp).mismatch(Fingerprint.parse(decode_fp)) == ["config", "weights"]
    prompt = random_prompt(seed=5, num_tokens=40)
    call = open_generate(decode, prefill.grpc, "other-model-0", prompt, greedy(8))
    # The prefill worker learns the model at SetDestination, which races the Submit: a Submit that
    # comes after the refusal finds the request already dropped and is refused (ABORTED). Either
    # way the decode stream is read to its end (not cancelled), for the refusal's reason.
    try:
        submit(prefill, decode.grpc, "other-model-0", prompt, greedy(8))
        submit_error = None
    except grpc.RpcError as exc:
        submit_error = exc
    assert submit_error is None or submit_error.code() == grpc.StatusCode.ABORTED, submit_error
    result = collect(call)
    assert result.error is not None and not result.token_ids
    details = result.error.details()
    assert "FAILED_PRECONDITION" in details and "model fingerprints differ in config, weights" in details
    assert prefill_fp in details and decode_fp in details, details
    wait_idle(prefill, decode)                # both sides dropped the request


def test_prefill_and_decode_of_different_kv_layouts_refuse_each_other(spawn, tiny_model_dir):
    """Same model, another block size: refused at the handshake, before any KV is written."""
    prefill, decode = start_pair(spawn, tiny_model_dir("llama"), *LEASE_FLAGS,
                                 prefill_flags=tuple(pool_flags(block_size=8)), decode_flags=tuple(pool_flags()),
                                 names=("prefill-b8", "decode-b16"))
    result = generate(prefill, decode, "other-layout-0", random_prompt(seed=6, num_tokens=40), greedy(4))
    assert result.submit_error is None or result.submit_error.code() == grpc.StatusCode.ABORTED, result.submit_error
    assert result.error is not None and result.error.code() == grpc.StatusCode.UNAVAILABLE, result.error
    details = result.error.details()
    assert "model fingerprints differ in kv" in details, details
    assert prefill.stats().fingerprint in details and decode.stats().fingerprint in details
    wait_idle(prefill, decode)


def test_a_decode_worker_refuses_a_prefill_worker_that_answers_another_fingerprint(spawn, tiny_model_dir):
    """The other direction: a prefill side that accepts the destination but reports another model
    (or none, like a worker that predates the handshake) is refused by the decode worker, which
    fails the request and aborts it there."""
    decode = spawn("decode", tiny_model_dir("llama"), *pool_flags(), *LEASE_FLAGS, name="decode-llama")
    mine = Fingerprint.parse(decode.stats().fingerprint)
    theirs = Fingerprint(ModelIdentity(mine.model.protocol + 1, mine.model.architecture, mine.model.config,
                                       mine.model.weights, mine.model.name), mine.dtype, mine.kv, mine.tp)
    peer = RoguePrefill()
    try:
        for request_id, answer in (("newer-protocol", str(theirs)), ("no-fingerprint", "")):
            peer.fingerprint = answer
            call = open_generate(decode, peer.address, request_id, random_prompt(seed=7, num_tokens=20), greedy(4))
            result = collect(call)
            assert result.error is not None and not result.token_ids
            details = result.error.details()
            assert f"refused prefill worker {peer.address}" in details, details
            assert str(mine) in details and (answer or "no valid model fingerprint") in details, details
            wait_until(lambda r=request_id: r in peer.aborted, 10, f"Abort({request_id}) at the prefill side")
        wait_idle(decode)
    finally:
        peer.close()
