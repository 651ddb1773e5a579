"""Tandem.Multiplex (router/grpc_api.py) and the async SDK on it (tandem_client/): many requests on
one stream give each its own tokens; a bad request fails its key alone with the status Generate
would give; a cancelled key, a client gone, a deadline passed or a key reused abort what was open at
both workers; the stream ends cleanly when the client is done."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem_client import AsyncTandemClient, InvalidArgument, TandemError, Unauthenticated
from tests.fake_tandem_service import generate_only_tandem_server
from tests.router.clusters import run, until
from tests.router.fake_workers import fake_completion
from tests.router.hostile_cases import GRPC_CASES, LIMITS


def _start(key: int, prompt: list[int], max_tokens: int) -> tandem_pb2.MultiplexStart:
    return tandem_pb2.MultiplexStart(key=key, completion=tandem_pb2.CompletionRequest(
        prompt_token_ids=prompt, sampling=tandem_pb2.Sampling(max_tokens=max_tokens)))


async def _open_stream(cluster):
    channel = grpc.aio.insecure_channel(cluster.router.grpc_address)
    return channel, tandem_pb2_grpc.TandemStub(channel).Multiplex()


def test_many_requests_on_one_stream_each_get_their_own_tokens(loop_thread, tokenizer):
    async def body(cluster):
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            prompts = [[i, i + 1, i + 2] for i in range(1, 41)]
            outs = await asyncio.gather(*(client.generate(p, max_tokens=5 + i % 7, request_id=f"r{i}")
                                          for i, p in enumerate(prompts)))
            chat = await client.chat([{"role": "user", "content": "hi"}], max_tokens=3)
            assert client._multiplex is not None and client._multiplex._call is not None   # one stream, still open
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            assert out.token_ids == fake_completion(prompt, 5 + i % 7)
            assert out.finish_reason == "length" and out.usage.completion_tokens == 5 + i % 7
        assert len(chat.token_ids) == 3
        assert cluster.decodes[0].state.active == set()
    run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.005})


def test_each_bad_request_fails_its_key_alone_with_the_status_generate_gives(loop_thread, tokenizer):
    """Every hostile case of test_hostile_requests on one stream, between two good requests."""
    async def body(cluster):
        channel, call = await _open_stream(cluster)
        starts = [_start(0, [5, 6], 4)]
        for key, (_, method, request_msg, _, _) in enumerate(GRPC_CASES, start=1):
            bad = tandem_pb2.MultiplexStart(key=key)
            getattr(bad, "chat" if method == "Chat" else "completion").CopyFrom(request_msg)
            starts.append(bad)
        starts.append(_start(100, [7, 8], 4))
        await call.write(tandem_pb2.MultiplexRequest(start=starts))
        await call.done_writing()
        events = [e for response in [r async for r in call] for e in response.events]
        await channel.close()
        return events, await call.code()
    events, status = run(loop_thread, tokenizer, body, **LIMITS)
    assert status == grpc.StatusCode.OK
    for key, (case, _, _, code, field) in enumerate(GRPC_CASES, start=1):
        [failure] = [e for e in events if e.key == key]
        assert failure.error_code == code.value[0] and field in failure.error, (case, failure.error)
    for key, prompt in ((0, [5, 6]), (100, [7, 8])):
        tokens = [t for e in events if e.key == key for t in e.chunk.token_ids]
        assert tokens == fake_completion(prompt, 4)
        assert [e.chunk.finish_reason for e in events if e.key == key][-1] == "length"


def test_a_start_without_a_request_fails_its_key(loop_thread, tokenizer):
    async def body(cluster):
        channel, call = await _open_stream(cluster)
        await call.write(tandem_pb2.MultiplexRequest(start=[tandem_pb2.MultiplexStart(key=9)]))
        await call.done_writing()
        events = [e for response in [r async for r in call] for e in response.events]
        await channel.close()
        return events
    [event] = run(loop_thread, tokenizer, body)
    assert event.key == 9 and event.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "completion or a chat request" in event.error


def test_a_cancelled_key_is_aborted_at_both_workers_and_the_stream_goes_on(loop_thread, tokenizer):
    async def body(cluster):
        decode, prefill = cluster.decodes[0], cluster.prefills[0]
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            async for _ in client.generate_stream([1, 2, 3], max_tokens=200, request_id="given-up"):
                break     # the caller stops reading: the SDK cancels the key
            await until(lambda: not decode.state.active and len(prefill.state.aborted) == 1)
            [rid] = decode.state.aborted
            assert rid.startswith("given-up.") and prefill.state.aborted == [rid]
            out = await client.generate([4, 5], max_tokens=3)
            assert out.token_ids == fake_completion([4, 5], 3)
    run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.02})


def test_a_start_cancelled_in_its_own_message_is_aborted_at_both_workers(loop_thread, tokenizer):
    """A small request is dispatched as its start is read, before its task runs: a cancel in the
    same message stops the task before it starts, and the request must still end at both workers
    and in the router's counts."""
    async def body(cluster):
        decode, prefill = cluster.decodes[0], cluster.prefills[0]
        channel, call = await _open_stream(cluster)
        await call.write(tandem_pb2.MultiplexRequest(start=[_start(1, [1, 2], 200)], cancel=[1]))
        await call.write(tandem_pb2.MultiplexRequest(start=[_start(2, [3, 4], 3)]))
        events = []
        while not any(e.key == 2 and e.chunk.finish_reason for e in events):
            events.extend((await call.read()).events)
        await until(lambda: not decode.state.active and len(prefill.state.aborted) == 1)
        [rid] = decode.state.aborted
        assert prefill.state.aborted == [rid] and rid in decode.state.seen
        assert not [e for e in events if e.key == 1]
        dispatcher = cluster.router.dispatcher
        assert dispatcher.num_waiting == 0
        assert [w.num_inflight for w in cluster.router.registry.all()] == [0, 0]
        call.cancel()
        await channel.close()
    run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.02})


def test_a_client_that_goes_away_aborts_every_request_it_had_open(loop_thread, tokenizer):
    async def body(cluster):
        decode = cluster.decodes[0]
        channel, call = await _open_stream(cluster)
        await call.write(tandem_pb2.MultiplexRequest(start=[_start(k, [k, k], 200) for k in range(1, 4)]))
        await call.read()             # tokens flow for all three
        await until(lambda: len(decode.state.active) == 3)
        call.cancel()                 # the client is gone
        await until(lambda: not decode.state.active and len(cluster.prefills[0].state.aborted) == 3)
        assert len(decode.state.aborted) == 3
        await channel.close()
    run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.02})


def test_a_key_already_open_ends_the_stream_with_invalid_argument(loop_thread, tokenizer):
    async def body(cluster):
        decode = cluster.decodes[0]
        channel, call = await _open_stream(cluster)
        await call.write(tandem_pb2.MultiplexRequest(start=[_start(7, [1, 2], 200)]))
        await until(lambda: len(decode.state.active) == 1)
        await call.write(tandem_pb2.MultiplexRequest(start=[_start(7, [3, 4], 200)]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        await until(lambda: not decode.state.active)     # the first request is aborted too
        await channel.close()
        return info.value
    error = run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.02})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "key 7 is already open" in error.details()


def test_bytes_that_are_no_message_end_the_stream_with_invalid_argument(loop_thread, tokenizer):
    async def body(cluster):
        channel = grpc.aio.insecure_channel(cluster.router.grpc_address)
        call = channel.stream_stream("/tandem.v1.Tandem/Multiplex", request_serializer=lambda b: b,
                                     response_deserializer=tandem_pb2.MultiplexResponse.FromString)()
        await call.write(bytes([0x0A, 0x05, 0x12, 0x03, 0x12, 0x01, 0xFF]))   # start.completion.prompt = b"\xff"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        await channel.close()
        return info.value
    error = run(loop_thread, tokenizer, body)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid message" in error.details()


def test_the_sdk_deadline_fails_the_request_and_aborts_it_at_the_workers(loop_thread, tokenizer):
    async def body(cluster):
        decode = cluster.decodes[0]
        async with AsyncTandemClient(cluster.router.grpc_address, timeout_s=0.3) as client:
            with pytest.raises(TandemError) as info:
                await client.generate([1, 2], max_tokens=200)
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: not decode.state.active and len(decode.state.aborted) == 1)
    run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.02})


def test_the_api_key_guards_the_stream(loop_thread, tokenizer):
    async def body(cluster):
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            with pytest.raises(Unauthenticated):
                await client.generate([1, 2], max_tokens=2)
        async with AsyncTandemClient(cluster.router.grpc_address, api_key="s3cret") as client:
            assert (await client.generate([1, 2], max_tokens=2)).token_ids == fake_completion([1, 2], 2)
            with pytest.raises(InvalidArgument, match="prompt"):
                await client.generate([], max_tokens=2)
            assert (await client.generate([3], max_tokens=1)).token_ids == fake_completion([3], 1)
    run(loop_thread, tokenizer, body, api_key="s3cret")


def test_a_router_that_stops_fails_the_open_requests_and_the_next_request_reopens(loop_thread, tokenizer):
    async def body(cluster):
        client = AsyncTandemClient(cluster.router.grpc_address)
        stream = client.generate_stream([1, 2], max_tokens=200)
        await stream.__anext__()
        await cluster.router.stop()
        with pytest.raises(TandemError) as info:
            async for _ in stream:
                pass
        with pytest.raises(TandemError):          # nothing listens there now: refused, not hung
            await asyncio.wait_for(client.generate([3], max_tokens=1), 10)
        await client.close()
        return info.value.code
    code = run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.02})
    assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def test_the_sdk_makes_a_call_per_request_on_a_server_without_multiplex():
    server, stub, port = generate_only_tandem_server(0.002)

    async def main():
        async with AsyncTandemClient(f"127.0.0.1:{port}") as client:
            outs = await asyncio.gather(*(client.generate("x", max_tokens=3) for _ in range(3)))
            after = await client.generate("y", max_tokens=2)
            return outs, after, client._multiplex
    try:
        outs, after, multiplex = asyncio.run(main())
    finally:
        server.stop(None)
    assert [len(o.token_ids) for o in outs] == [3, 3, 3] and len(after.token_ids) == 2
    assert multiplex is None and len(stub.requests) == 4


def test_the_sdk_writes_nothing_before_the_router_says_the_stream_is_ready():
    """A write racing a server's refusal could turn its status into INTERNAL "Internal error from
    Core" (grpc/grpc#36066: ~5% of calls to a server without Multiplex under load); so the SDK
    writes only once it has the router's MULTIPLEX_READY. Fails when the SDK writes at once."""
    from protos.limits import MULTIPLEX_READY
    seen: dict[str, float] = {}

    class SlowToAnswer(tandem_pb2_grpc.TandemServicer):
        async def Multiplex(self, request_iterator, context):
            loop = asyncio.get_running_loop()
            first = loop.create_future()

            async def read():
                async for message in request_iterator:
                    if not first.done():
                        seen["first_message"] = loop.time()
                        first.set_result(message)
            reader = loop.create_task(read())
            await asyncio.sleep(0.3)
            seen["ready"] = loop.time()
            await context.send_initial_metadata((MULTIPLEX_READY,))
            message = await first
            yield tandem_pb2.MultiplexResponse(events=[tandem_pb2.MultiplexEvent(
                key=message.start[0].key, chunk=tandem_pb2.CompletionChunk(text="t", finish_reason="length"))])
            reader.cancel()

    async def main():
        server = grpc.aio.server()
        tandem_pb2_grpc.add_TandemServicer_to_server(SlowToAnswer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncTandemClient(f"127.0.0.1:{port}") as client:
                return await asyncio.wait_for(client.generate("x", max_tokens=1), 10)
        finally:
            await server.stop(None)
    out = asyncio.run(main())
    assert out.text == "t" and out.finish_reason == "length"
    assert seen["first_message"] > seen["ready"]
