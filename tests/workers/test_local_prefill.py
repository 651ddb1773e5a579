"""A decode worker asked to prefill a prompt itself (``GenerateRequest.local_prefill``,
conditional disaggregation) gives exactly what the colocated `LLM` gives, beside requests whose
KV a prefill worker ships into the same pool, and loses nothing when a request ends early.

Real processes on the tiny random-weight Llama (tests/workers/conftest.py)."""
from __future__ import annotations

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
    prompts_for,
    run_concurrently,
    wait_idle,
    wait_until,
)

LENGTHS = [3, 90, 17, 33, 64, 5, 48, 16]
MAX_TOKENS = [5, 24, 12, 8, 20, 24, 6, 15]


def open_local(decode, request_id: str, prompt: list[int], sampling: worker_pb2.SamplingParams):
    return open_generate(decode, "", request_id, prompt, sampling, timeout_s=60, local_prefill=True)


def local_prefills(decode) -> float:
    return metric(scrape(decode.metrics), "tandem_local_prefills_total")


def test_local_and_shipped_prompts_side_by_side_match_colocated(pd_pair, reference):
    prefill, decode = pd_pair
    before = local_prefills(decode)
    prompts = prompts_for(LENGTHS, seed=7000)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    seeded = SamplingParams(temperature=0.8, seed=99, max_tokens=10, ignore_eos=True)
    expected = reference(prompts + prompts[:1], params + [seeded])

    def local(i: int):
        return collect(open_local(decode, f"local-{i}", prompts[i], greedy(MAX_TOKENS[i])))

    def shipped(i: int):
        return generate(prefill, decode, f"shipped-{i}", prompts[i], greedy(MAX_TOKENS[i]))

    def local_seeded():
        sampling = worker_pb2.SamplingParams(temperature=0.8, seed=99, max_tokens=10, ignore_eos=True)
        return collect(open_local(decode, "local-seeded", prompts[0], sampling))

    # Even requests prefill here, odd ones over kvtransfer: one pool, one running batch.
    fns = [(lambda i=i: local(i) if i % 2 == 0 else shipped(i)) for i in range(len(prompts))]
    results = run_concurrently([*fns, local_seeded])
    for i, (result, ref) in enumerate(zip(results, expected)):
        assert result.error is None, (i, result.error)
        assert result.token_ids == ref.token_ids, f"request {i} ({'local' if i % 2 == 0 else 'shipped'})"
        final = result.final
        assert (final.finish_reason, final.num_prompt_tokens, final.num_output_tokens) == \
            ("length", LENGTHS[i] if i < len(LENGTHS) else LENGTHS[0], len(ref.token_ids))
    assert local_prefills(decode) - before == len(prompts) // 2 + 1
    wait_idle(prefill, decode)


def test_a_local_prefill_cancelled_or_aborted_frees_its_blocks(pd_pair):
    prefill, decode = pd_pair
    [prompt] = prompts_for([80], seed=7100)
    call = open_local(decode, "local-cancel", prompt, greedy(240))
    first = next(call)
    assert first.token_ids
    wait_until(lambda: decode.stats().kv_blocks_used > 0, 10, "the request's blocks in use")
    call.cancel()
    wait_idle(decode)
    call = open_local(decode, "local-abort", prompt, greedy(240))
    next(call)
    decode.decode_stub.Abort(worker_pb2.AbortRequest(request_id="local-abort"), timeout=10)
    result = collect(call)
    assert result.final.finish_reason == "abort"
    wait_idle(decode)


def test_a_local_request_has_no_prefill_worker_to_move(pd_pair):
    prefill, decode = pd_pair
    [prompt] = prompts_for([40], seed=7200)
    call = open_local(decode, "local-move", prompt, greedy(200))
    next(call)
    with pytest.raises(grpc.RpcError) as err:
        decode.decode_stub.SetPrefill(worker_pb2.SetPrefillRequest(request_id="local-move",
                                                                   prefill_address=prefill.grpc), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    call.cancel()
    wait_idle(decode)


@pytest.mark.parametrize("prefill_address, local", [("", False), ("127.0.0.1:1", True)])
def test_a_prefill_worker_or_local_prefill_exactly_one(pd_pair, prefill_address, local):
    prefill, decode = pd_pair
    result = collect(open_generate(decode, prefill_address, f"both-{local}", [1, 2, 3], greedy(4), timeout_s=10,
                                   local_prefill=local))
    assert result.error is not None and result.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "local_prefill" in result.error.details()
