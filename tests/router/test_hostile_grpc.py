"""Black-box: the public gRPC port's own limits, and what a tenant learns there.

A message past the HTTP body limit, a prompt_token_ids list past the context, a Multiplex
message or stream with too many requests, a chat with too many messages, too many calls at once:
each is refused with an exact status before the router does the work. Error messages quote
client input clipped, client request ids with control characters are refused, and tenants see
no worker address (GetCluster, /v1/cluster, the "failed twice" error, reflection).
"""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from protos.auth import metadata as secret_metadata
from protos.auth import require_secret
from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc, worker_pb2
from router.config import RouterConfig
from router.grpc_api import TandemServicer
from router.server import Router
from tests.router.clusters import MODEL, fake_cluster_running, run, until
from tests.router.fake_workers import FakePrefill, FakeWorker, fake_completion

VOCAB = 49152
MAX_MODEL_LEN = 256   # the fake workers'
LIMITS = {"max_prompt_chars": 100_000, "max_request_body_bytes": 256 << 10, "max_waiting": 8}
BIG = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
       ("grpc.max_metadata_size", 16 << 20)]   # so a client sees what the router really sends


@pytest.fixture(scope="module")
def cluster(loop_thread, tokenizer):
    with fake_cluster_running(loop_thread, tokenizer, **LIMITS) as cluster:
        yield cluster


@pytest.fixture
def stub(cluster):
    with grpc.insecure_channel(cluster.router.grpc_address, options=BIG) as channel:
        yield tandem_pb2_grpc.TandemStub(channel)


def refusal(call) -> grpc.RpcError:
    """The error a call (a callable doing it) ends with."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def generate(stub, timeout_s: float = 30.0, metadata=(), **fields) -> list[tandem_pb2.CompletionChunk]:
    fields.setdefault("sampling", tandem_pb2.Sampling(max_tokens=2))
    return list(stub.Generate(tandem_pb2.CompletionRequest(**fields), timeout=timeout_s, metadata=metadata))


def http_error(cluster, body: dict, status: int, path: str = "/v1/completions") -> dict:
    response = httpx.post(cluster.http + path, content=json.dumps(body), timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text[:500]
    return response.json()["error"]


# -- sizes -------------------------------------------------------------------------------------

def test_a_message_past_the_http_body_limit_is_resource_exhausted(cluster, stub):
    err = refusal(lambda: generate(stub, prompt="x" * (300 << 10)))   # > max_request_body_bytes=256 KiB
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()[:300]
    assert [t for c in generate(stub, prompt_token_ids=[5, 6]) for t in c.token_ids] == fake_completion([5, 6], 2)


def test_a_prompt_token_ids_list_past_the_context_is_refused_before_it_is_read(cluster, stub):
    """Its length is checked before its ids: the id outside the vocabulary at its end is never looked at."""
    ids = [1] * 300 + [VOCAB + 7]
    err = refusal(lambda: generate(stub, prompt_token_ids=ids))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"maximum context length is {MAX_MODEL_LEN} tokens, but the prompt has 301 tokens" in err.details()
    error = http_error(cluster, {"prompt": ids, "max_tokens": 1}, 400)
    assert error["param"] == "prompt" and "maximum context length" in error["message"], error


def test_a_chat_with_many_messages_is_templated_off_the_loop_and_too_many_are_refused(cluster, stub):
    servicer = TandemServicer(cluster.router.frontend)
    empty = tandem_pb2.ChatRequest(messages=[tandem_pb2.ChatMessage(role="user")] * 1000)
    assert servicer.preparer(empty)[1] is False          # no characters, but 1000 messages: a thread
    small = tandem_pb2.ChatRequest(messages=[tandem_pb2.ChatMessage(role="user", content="hi")])
    assert servicer.preparer(small)[1] is True
    many = tandem_pb2.ChatRequest(messages=[tandem_pb2.ChatMessage(role="user")] * 5000)
    err = refusal(lambda: list(stub.Chat(many, timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "5000 messages, more than the 4096 one chat request may hold" in err.details()
    error = http_error(cluster, {"messages": [{"role": "user", "content": ""}] * 5000}, 400, "/v1/chat/completions")
    assert error["param"] == "messages" and "5000 messages" in error["message"], error


# -- Multiplex ---------------------------------------------------------------------------------

def _start(key: int, max_tokens: int = 2) -> tandem_pb2.MultiplexStart:
    return tandem_pb2.MultiplexStart(key=key, completion=tandem_pb2.CompletionRequest(
        prompt_token_ids=[3, key % 100 + 1], sampling=tandem_pb2.Sampling(max_tokens=max_tokens)))


def test_a_multiplex_message_with_more_starts_than_max_waiting_ends_the_stream(cluster, stub):
    seen = len(cluster.decodes[0].state.seen)
    cap = max(LIMITS["max_waiting"], 64)
    err = refusal(lambda: list(stub.Multiplex(iter([tandem_pb2.MultiplexRequest(
        start=[_start(k) for k in range(cap + 1)])]), timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"a Multiplex message starts {cap + 1} requests, more than the {cap}" in err.details()
    assert len(cluster.decodes[0].state.seen) == seen   # not one of them was started
    # As many as the cap in one message are read (those past max_waiting: 429s of their own).
    responses = list(stub.Multiplex(iter([tandem_pb2.MultiplexRequest(start=[_start(k) for k in range(cap)])]),
                                    timeout=30))
    last = {e.key for r in responses for e in r.events if e.error_code or e.chunk.finish_reason}
    assert last == set(range(cap))


def test_a_multiplex_stream_holds_at_most_4x_max_waiting_open_requests(loop_thread, tokenizer):
    async def body(cluster):
        async with grpc.aio.insecure_channel(cluster.router.grpc_address) as channel:
            call = tandem_pb2_grpc.TandemStub(channel).Multiplex()
            first_chunk: set[int] = set()
            failed: dict[int, tuple[int, str]] = {}

            async def read() -> None:
                async for response in call:
                    for e in response.events:
                        if e.error_code:
                            failed[e.key] = (e.error_code, e.error)
                        elif e.chunk.token_ids:
                            first_chunk.add(e.key)
            reader = asyncio.get_running_loop().create_task(read())
            for batch in range(4):   # 8 open, two at a time (max_waiting=2 wait for a first token at once)
                keys = [2 * batch, 2 * batch + 1]
                await call.write(tandem_pb2.MultiplexRequest(start=[_start(k, 250) for k in keys]))
                await until(lambda: first_chunk >= set(keys) or bool(failed))
            assert not failed
            await call.write(tandem_pb2.MultiplexRequest(start=[_start(8, 250)]))
            await until(lambda: 8 in failed)
            assert failed[8][0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "8 requests are open on this Multiplex stream" in failed[8][1]
            await call.write(tandem_pb2.MultiplexRequest(cancel=[0]))   # room again (a message's starts go first)
            await call.write(tandem_pb2.MultiplexRequest(start=[_start(9, 250)]))
            await until(lambda: 9 in first_chunk or 9 in failed)
            assert 9 not in failed
            await call.write(tandem_pb2.MultiplexRequest(cancel=list(range(1, 10))))
            await call.done_writing()
            await reader
            assert await call.code() == grpc.StatusCode.OK
        await until(lambda: not cluster.decodes[0].state.active)
    run(loop_thread, tokenizer, body, max_waiting=2, decode_options={"token_interval_s": 0.05})


# -- concurrent calls --------------------------------------------------------------------------

def test_calls_past_the_concurrent_rpc_cap_are_resource_exhausted_not_queued(loop_thread, tokenizer):
    for bad in ({"grpc_max_concurrent_rpcs": 0}, {"grpc_max_concurrent_streams": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be >= 1"):
            RouterConfig(**bad)

    async def body(cluster):
        async with grpc.aio.insecure_channel(cluster.router.grpc_address) as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            request = tandem_pb2.CompletionRequest(prompt_token_ids=[1, 2],
                                                   sampling=tandem_pb2.Sampling(max_tokens=200))
            calls = [stub.Generate(request), stub.Generate(request)]
            for call in calls:
                await call.read()   # both in progress
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListModels(tandem_pb2.ListModelsRequest(), timeout=20)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            for call in calls:
                call.cancel()
            for _ in range(100):   # the cap frees as the cancelled calls end
                try:
                    models = await stub.ListModels(tandem_pb2.ListModelsRequest(), timeout=20)
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.05)
            assert [m.id for m in models.models] == [MODEL]
    run(loop_thread, tokenizer, body, grpc_max_concurrent_rpcs=2, decode_options={"token_interval_s": 0.05})


# -- what error messages and logs echo ----------------------------------------------------------

def test_error_messages_quote_client_input_clipped(cluster, stub):
    err = refusal(lambda: generate(stub, model="m" * 100_000, prompt="hi"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert len(err.details()) < 300 and "...<99936 more characters>" in err.details(), err.details()[:300]
    err = refusal(lambda: generate(stub, model="a\x1b[2J\nb", prompt="hi"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "a\\x1b[2J\\nb" in err.details(), err.details()
    error = http_error(cluster, {"model": "m" * 100_000, "prompt": "hi"}, 404)
    assert error["param"] == "model" and len(error["message"]) < 300, error["message"][:300]


@pytest.mark.parametrize("request_id", ["r\x1b[2J", "line\nWARNING forged", "tab\there", "nul\x00", "rtl\u202e"])
def test_a_request_id_with_control_characters_is_refused(cluster, stub, request_id):
    err = refusal(lambda: generate(stub, prompt="hi", request_id=request_id))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id must hold printable characters only" in err.details()
    assert not any(c in err.details() for c in "\x1b\n\t\x00\u202e")
    error = http_error(cluster, {"prompt": "hi", "request_id": request_id}, 400)
    assert error["param"] == "request_id", error


# -- what a tenant learns about the cluster -----------------------------------------------------

def test_tenants_see_no_worker_addresses_and_the_secret_holder_does(cluster, stub):
    addresses = sorted(w.address for w in cluster.workers)
    ports = [a.rsplit(":", 1)[1] for a in addresses]
    for metadata in ((), secret_metadata("x" * 43)):
        view = stub.GetCluster(tandem_pb2.GetClusterRequest(), timeout=10, metadata=metadata).workers
        assert [(w.role, w.address, w.healthy) for w in view] == [("decode", "", True), ("prefill", "", True)]
    view = stub.GetCluster(tandem_pb2.GetClusterRequest(), timeout=10,
                           metadata=secret_metadata(require_secret("the test"))).workers
    assert sorted(w.address for w in view) == addresses
    text = httpx.get(cluster.http + "/v1/cluster", timeout=10).text
    assert json.loads(text)["workers"][0]["kv_blocks_total"] == 1000
    assert not any(port in text for port in ports), text


def test_reflection_lists_only_the_public_services(cluster):
    with grpc.insecure_channel(cluster.router.grpc_address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert services == {"tandem.v1.Tandem", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


class _UnreachableDecode(FakePrefill):
    """A prefill worker that cannot write any request's KV: it refuses each with UNAVAILABLE,
    naming the decode worker, as a real one reports a failed transfer."""

    async def Session(self, request_iterator, context):
        async for message in request_iterator:
            for request in message.submit:
                self.state.seen.append(request.request_id)
            if message.submit:
                yield worker_pb2.PrefillSessionResponse(results=[worker_pb2.SubmitResponse(
                    request_id=r.request_id, error_code=grpc.StatusCode.UNAVAILABLE.value[0],
                    error=f"cannot write KV to {r.decode_address} (10.1.2.3:5555)") for r in message.submit])


def test_a_request_failing_twice_hears_which_role_failed_not_where(loop_thread, tokenizer):
    async def main():
        prefills = [FakeWorker("prefill"), FakeWorker("prefill")]
        for w in prefills:
            w.servicer = _UnreachableDecode(w.state)
        decode = FakeWorker("decode", token_interval_s=0.05)
        workers = [await w.start() for w in (*prefills, decode)]
        config = RouterConfig(model=MODEL, http_port=-1, grpc_port=0, prefill=(workers[0].address, workers[1].address),
                              decode=(decode.address,), heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
        router = await Router(config, tokenizer).start()
        try:
            await router.registry.wait_healthy("prefill", 2)
            await router.registry.wait_healthy("decode", 1)
            async with grpc.aio.insecure_channel(router.grpc_address) as channel:
                call = tandem_pb2_grpc.TandemStub(channel).Generate(tandem_pb2.CompletionRequest(
                    prompt_token_ids=[1, 2, 3], sampling=tandem_pb2.Sampling(max_tokens=100)), timeout=30)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
            details = err.value.details()
            assert err.value.code() == grpc.StatusCode.INTERNAL, details
            assert "failed twice for the same reason on different prefill workers" in details, details
            assert "cannot write KV to <worker> (<worker>)" in details, details
            assert not any(w.address in details for w in workers) and "127.0.0.1" not in details, details
            assert all(len(w.state.seen) == 1 for w in prefills)
        finally:
            await router.stop()
            for w in workers:
                await w.stop()
    loop_thread.run(main(), 60)


def test_one_connection_holds_at_most_max_concurrent_streams(loop_thread, tokenizer):
    """The HTTP/2 cap is per connection: a third call on a connection with two open waits (here
    past its deadline), while a call on another connection is answered."""
    async def body(cluster):
        address = cluster.router.grpc_address
        own = [("grpc.use_local_subchannel_pool", 1)]   # a connection each (channels share them by default)
        async with grpc.aio.insecure_channel(address, options=own) as busy, \
                grpc.aio.insecure_channel(address, options=own) as other:
            stub = tandem_pb2_grpc.TandemStub(busy)
            request = tandem_pb2.CompletionRequest(prompt_token_ids=[1, 2],
                                                   sampling=tandem_pb2.Sampling(max_tokens=200))
            calls = [stub.Generate(request), stub.Generate(request)]
            for call in calls:
                await call.read()   # both streams open on `busy`
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListModels(tandem_pb2.ListModelsRequest(), timeout=2)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            models = await tandem_pb2_grpc.TandemStub(other).ListModels(tandem_pb2.ListModelsRequest(), timeout=20)
            assert [m.id for m in models.models] == [MODEL]
            for call in calls:
                call.cancel()
    run(loop_thread, tokenizer, body, grpc_max_concurrent_streams=2, decode_options={"token_interval_s": 0.05})
