"""Client request ids are labels (router.dispatch): the workers see a unique internal id, so a
reused client id never joins or aborts another client's request, and the client still sees its
own id; a request failing twice for the same reason is not tried on more workers."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem_client import AsyncTandemClient, TandemError
from tests.router.clusters import run, until
from tests.router.fake_workers import fake_completion


def test_a_reused_client_request_id_never_joins_or_aborts_another_clients_request(loop_thread, tokenizer):
    async def body(cluster):
        decode = cluster.decodes[0]
        channel = grpc.aio.insecure_channel(cluster.router.grpc_address)
        stub = tandem_pb2_grpc.TandemStub(channel)
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            async def one(prompt):
                request = tandem_pb2.CompletionRequest(request_id="same", prompt_token_ids=prompt,
                                                       sampling=tandem_pb2.Sampling(max_tokens=8))
                return [c async for c in stub.Generate(request)]

            async def abandoned():   # the same id again, given up after its first chunk
                async for _ in client.generate_stream([9, 9, 9], request_id="same", max_tokens=200):
                    return

            first, second, _ = await asyncio.gather(one([1, 2, 3]), one([4, 5, 6]), abandoned())
        await channel.close()
        for prompt, chunks in (([1, 2, 3], first), ([4, 5, 6], second)):
            assert [t for c in chunks for t in c.token_ids] == fake_completion(prompt, 8)
            assert {c.request_id for c in chunks} == {"same"}
        await until(lambda: not decode.state.active)
        assert len(set(decode.state.seen)) == 3
        assert all(rid.startswith("same.") and len(rid) == len("same.") + 16 for rid in decode.state.seen)
        # 64 random bits each: no run of ids shares a prefix that would let one guess the next.
        assert len({rid[len("same."):][:8] for rid in decode.state.seen}) == 3
        assert len(decode.state.aborted) == 1   # only the abandoned one was aborted, by its own id
    run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.01})


def test_a_request_failing_twice_for_the_same_reason_is_not_tried_on_more_workers(loop_thread, tokenizer):
    async def body(cluster):
        for decode in cluster.decodes:
            decode.servicer.fail_after_tokens = 0   # every stream ends at once with the same error
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            with pytest.raises(TandemError, match="failed twice for the same reason") as err:
                await client.generate([1, 2, 3], max_tokens=4)
        assert err.value.code == grpc.StatusCode.INTERNAL
        assert "failed twice for the same reason" in err.value.details
        assert "fake decode failure" in err.value.details
        assert "on different decode workers" in err.value.details
        assert not any(d.address in err.value.details for d in cluster.decodes)
        assert sum(len(d.state.seen) for d in cluster.decodes) == 2
    run(loop_thread, tokenizer, body, num_decode=4)


def test_requests_without_a_client_id_get_distinct_ids_that_the_client_sees(loop_thread, tokenizer):
    async def body(cluster):
        channel = grpc.aio.insecure_channel(cluster.router.grpc_address)
        stub = tandem_pb2_grpc.TandemStub(channel)
        request = tandem_pb2.CompletionRequest(prompt_token_ids=[1, 2, 3], sampling=tandem_pb2.Sampling(max_tokens=2))
        async def one():
            return [c async for c in stub.Generate(request)]
        streams = await asyncio.gather(*(one() for _ in range(20)))
        await channel.close()
        ids = [{c.request_id for c in chunks} for chunks in streams]
        assert all(len(one) == 1 for one in ids)   # one id per request, on every chunk
        ids = [one.pop() for one in ids]
        assert len(set(ids)) == 20 and all(ids)
        # 96 random bits per request: one id tells nothing about the next.
        assert len({i[:8] for i in ids}) == 20 and all(len(i) == 24 for i in ids)
        workers_see = set(cluster.decodes[0].state.seen)
        assert {rid.split(".")[0] for rid in workers_see} == set(ids)
    run(loop_thread, tokenizer, body)


def test_broken_kv_transfers_are_not_a_poison_request(loop_thread, tokenizer):
    """A failure the decode worker marks transient (its KV transfer broke) is retried on every
    pair max_attempts allows, however often it repeats: it is the link's fault, not the request's."""
    async def body(cluster):
        for decode in cluster.decodes:
            decode.servicer.fail_after_tokens = 0
            decode.servicer.fail_transient = True
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            with pytest.raises(TandemError) as err:
                await client.generate([1, 2, 3], max_tokens=4)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value.details
        assert "failed on 4 worker pairs" in err.value.details
        assert sum(len(d.state.seen) for d in cluster.decodes) == 4
    run(loop_thread, tokenizer, body, num_decode=4)
