"""Dispatch against fake workers: failover keeps one unbroken stream, disconnects abort at both
workers, 256 concurrent streams complete, registry membership and shutdown, a Submit refused or
never answered ends its request."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import msgpack
import pytest

from protos.auth import SecretStub, require_secret
from protos.auth import metadata as secret_metadata
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc, tandem_pb2, tandem_pb2_grpc, worker_pb2
from router.config import RouterConfig
from router.server import Router
from tandem_client import AsyncTandemClient, InvalidArgument, TandemError
from tests.router.clusters import MODEL, run, start_fake_cluster, until
from tests.router.fake_workers import FakeDecode, FakePrefill, FakeWorker, fake_completion


def admin_stub(channel) -> SecretStub:
    """The router's admin service, called as the controller does: with the cluster secret."""
    return SecretStub(admin_pb2_grpc.AdminStub(channel), require_secret("the test"))


def cluster_secret_metadata() -> tuple:
    """What GetCluster needs to name the workers' addresses (the controller sends it)."""
    return secret_metadata(require_secret("the test"))


def test_a_failing_decode_worker_is_replaced_mid_stream_without_gaps(loop_thread, tokenizer):
    async def body(cluster):
        bad, good = cluster.decodes
        bad.servicer.fail_after_tokens = 3
        good.servicer.fail_after_tokens = None
        cluster.router.registry.get(good.address).num_inflight = 1   # make least_load pick `bad` first
        prompt = [11, 12, 13]
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            chunks = [c async for c in client.generate_stream(prompt, max_tokens=10, temperature=0)]
        cluster.router.registry.get(good.address).num_inflight -= 1
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == fake_completion(prompt, 10)
        assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == 3
        assert any(rid.endswith(".retry1") for rid in good.state.seen)
    run(loop_thread, tokenizer, body, num_decode=2)


def test_a_dead_prefill_worker_is_removed_and_requests_go_elsewhere(loop_thread, tokenizer):
    async def body(cluster):
        dead = cluster.prefills[0]
        await dead.stop()
        await until(lambda: len(cluster.router.registry.healthy("prefill")) == 1)
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            out = await client.generate([5, 6, 7], max_tokens=4)
        assert out.token_ids == fake_completion([5, 6, 7], 4)
        assert cluster.router.registry.get(dead.address) is None
    run(loop_thread, tokenizer, body, num_prefill=2)


def test_client_disconnect_aborts_at_both_workers(loop_thread, tokenizer):
    async def body(cluster):
        decode, prefill = cluster.decodes[0], cluster.prefills[0]
        async with httpx.AsyncClient(base_url=cluster.http) as http:
            async with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200,
                                                                    "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        break                       # leave after the first chunk
        await until(lambda: not decode.state.active)
        await until(lambda: decode.state.aborted and prefill.state.aborted)
        assert decode.state.aborted[0] == prefill.state.aborted[0]
        await until(lambda: cluster.router.dispatcher.num_waiting == 0)
        assert all(w.num_inflight == 0 for w in cluster.router.registry.all())
    run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.02})


def test_requests_share_one_session_stream_per_decode_worker(loop_thread, tokenizer):
    """No gRPC call per request to the decode worker: every request rides the router's one
    Session stream, and one step's tokens for many requests come back in one message."""
    async def body(cluster):
        decode = cluster.decodes[0]
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            async def one(i: int):
                return [t async for c in client.generate_stream([200 + i, 9], max_tokens=6) for t in c.token_ids]
            results = await asyncio.gather(*(one(i) for i in range(40)))
        assert results == [fake_completion([200 + i, 9], 6) for i in range(40)]
        assert decode.state.num_sessions == 1
        assert len(decode.state.seen) == 40 and not decode.state.active
    run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.005})


def test_a_decode_worker_that_refuses_one_request_serves_the_others_on_the_session(loop_thread, tokenizer):
    async def body(cluster):
        decode = cluster.decodes[0]
        decode.servicer.refused_token = 41
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            slow = asyncio.ensure_future(client.generate([31, 32], max_tokens=40))
            await until(lambda: decode.state.active)
            with pytest.raises(InvalidArgument, match="token 41 is refused"):
                await client.generate([41], max_tokens=3)
            out = await slow
        assert out.token_ids == fake_completion([31, 32], 40)
        assert decode.state.num_sessions == 1         # the refusal did not break the stream
    run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.005})


def test_256_concurrent_streams_complete(loop_thread, tokenizer):
    async def body(cluster):
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            async def one(i: int):
                return [c async for c in client.generate_stream([100 + i, 7], max_tokens=8)]
            results = await asyncio.gather(*(one(i) for i in range(256)))
        for i, chunks in enumerate(results):
            assert [t for c in chunks for t in c.token_ids] == fake_completion([100 + i, 7], 8)
        assert sum(w.state.seen.__len__() for w in cluster.decodes) == 256
        assert not any(w.state.active for w in cluster.decodes)
    run(loop_thread, tokenizer, body, timeout_s=120, num_decode=2, decode_options={"token_interval_s": 0.01})


def test_register_and_deregister_rpcs_change_membership(loop_thread, tokenizer):
    async def body(cluster):
        extra = await FakeWorker("decode").start()
        try:
            stub_call = cluster.router.registry
            import grpc
            async with grpc.aio.insecure_channel(cluster.router.grpc_address) as channel:
                stub = tandem_pb2_grpc.TandemStub(channel)
                admin = admin_stub(channel)
                await admin.RegisterWorker(admin_pb2.RegisterWorkerRequest(role="decode", address=extra.address))
                await until(lambda: len(stub_call.healthy("decode")) == 2)
                with pytest.raises(grpc.aio.AioRpcError, match="role='judge': use one of") as bad:
                    await admin.RegisterWorker(admin_pb2.RegisterWorkerRequest(role="judge", address="a:1"))
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                found = await admin.DeregisterWorker(admin_pb2.DeregisterWorkerRequest(address=extra.address))
                assert found.found and len(stub_call.healthy("decode")) == 1
                cluster_view = await stub.GetCluster(tandem_pb2.GetClusterRequest(),
                                                     metadata=cluster_secret_metadata())
                assert {w.address for w in cluster_view.workers} == {w.address for w in cluster.workers}
        finally:
            await extra.stop()
    run(loop_thread, tokenizer, body)


def test_a_draining_worker_finishes_its_streams_and_takes_no_new_ones(loop_thread, tokenizer):
    async def body(cluster):
        import grpc

        first, second = cluster.decodes
        registry = cluster.router.registry
        registry.get(second.address).num_inflight = 1000       # least_load picks `first`
        async with AsyncTandemClient(cluster.router.grpc_address) as client, \
                grpc.aio.insecure_channel(cluster.router.grpc_address) as channel:
            stub, admin = tandem_pb2_grpc.TandemStub(channel), admin_stub(channel)
            stream = client.generate_stream([9, 8, 7], max_tokens=30)
            chunks = [await stream.__anext__()]                  # in flight on `first`
            assert registry.get(first.address).num_inflight == 1
            reply = await admin.DrainWorkers(admin_pb2.DrainWorkersRequest(addresses=[first.address]))
            assert list(reply.found) == [first.address]
            registry.get(second.address).num_inflight -= 1000
            view = {w.address: w for w in (await stub.GetCluster(tandem_pb2.GetClusterRequest(),
                                                                  metadata=cluster_secret_metadata())).workers}
            assert view[first.address].draining and not view[second.address].draining
            new = await client.generate([1, 2, 3], max_tokens=4)      # goes to `second` only
            assert new.token_ids == fake_completion([1, 2, 3], 4)
            chunks += [c async for c in stream]                       # the drained stream finishes
            assert [t for c in chunks for t in c.token_ids] == fake_completion([9, 8, 7], 30)
            assert registry.get(first.address).num_inflight == 0
            assert len(first.state.seen) == 1 and len(second.state.seen) == 1
            view = {w.address: w for w in (await stub.GetCluster(tandem_pb2.GetClusterRequest(),
                                                                  metadata=cluster_secret_metadata())).workers}
            assert view[first.address].num_requests == 1 and view[second.address].num_requests == 1
            assert (await admin.DeregisterWorker(admin_pb2.DeregisterWorkerRequest(address=first.address))).found
            assert registry.get(first.address) is None
            assert not (await admin.DrainWorkers(admin_pb2.DrainWorkersRequest(addresses=["nope:1"]))).found
    run(loop_thread, tokenizer, body, num_decode=2, decode_options={"token_interval_s": 0.02})


class _HoldingDecode(FakeDecode):
    """Holds a request whose prompt starts with ``HOLD`` before its first token until ``release``
    is set: a decode worker whose request waits for its prompt's KV behind a prefill backlog."""

    HOLD = 77

    def __init__(self, state, **options) -> None:
        super().__init__(state, **options)
        self.release = asyncio.Event()
        self.held: list[str] = []

    async def generate_one(self, request, context):
        if request.prompt_token_ids[0] == self.HOLD:
            self.held.append(request.request_id)
            await self.release.wait()
        async for response in super().generate_one(request, context):
            yield response


def test_a_draining_decode_worker_hands_its_requests_without_a_first_token_to_another(loop_thread, tokenizer):
    """Scale-down must not wait for a prefill backlog: a request the drained decode worker holds
    before its first token starts again on another decode worker at once (aborted at both of its
    old workers); a stream already running stays and finishes there. Drained in one call with
    `idle` (the least loaded worker), the request goes to the worker that stays, not to `idle`."""
    async def main():
        prefill = await FakeWorker("prefill").start()
        first = FakeWorker("decode")
        first.servicer = _HoldingDecode(first.state, token_interval_s=0.02)
        second = await FakeWorker("decode", token_interval_s=0.02).start()
        idle = await FakeWorker("decode", token_interval_s=0.02).start()
        await first.start()
        router = await Router(RouterConfig(model=MODEL, http_port=-1, grpc_port=0, prefill=(prefill.address,),
                                           decode=(first.address, second.address, idle.address),
                                           heartbeat_interval_s=0.2),
                              tokenizer).start()
        try:
            registry = router.registry
            await registry.wait_healthy("decode", 3)
            await registry.wait_healthy("prefill", 1)
            registry.get(second.address).num_inflight = 1000         # least_load picks `first`
            registry.get(idle.address).num_inflight = 1000
            async with AsyncTandemClient(router.grpc_address) as client, \
                    grpc.aio.insecure_channel(router.grpc_address) as channel:
                running = client.generate_stream([9, 8, 7], max_tokens=30)
                chunks = [await running.__anext__()]                 # streaming on `first`

                async def collect(prompt):
                    return [t async for c in client.generate_stream(prompt, max_tokens=10) for t in c.token_ids]

                held = asyncio.ensure_future(collect([_HoldingDecode.HOLD, 5, 6]))
                await until(lambda: first.servicer.held)
                assert registry.get(first.address).num_inflight == 2
                registry.get(idle.address).num_inflight -= 1000     # least_load would pick `idle` now
                reply = await admin_stub(channel).DrainWorkers(
                    admin_pb2.DrainWorkersRequest(addresses=[first.address, idle.address]))
                assert list(reply.found) == [first.address, idle.address]
                registry.get(second.address).num_inflight -= 1000
                # `first` never releases it: the request completes on `second`.
                assert await asyncio.wait_for(held, 10) == fake_completion([_HoldingDecode.HOLD, 5, 6], 10)
                moved = first.servicer.held[0]
                assert moved in first.state.aborted and moved in prefill.state.aborted
                assert [rid for rid in second.state.seen if rid.startswith(moved)] == [f"{moved}.retry1"]
                assert not idle.state.seen
                chunks += [c async for c in running]                 # the running stream stays and ends
                assert [t for c in chunks for t in c.token_ids] == fake_completion([9, 8, 7], 30)
                assert registry.get(first.address).num_inflight == 0   # drained: the controller may stop it
                assert not first.servicer.release.is_set()
        finally:
            await router.stop()
            for worker in (prefill, first, second, idle):
                await worker.stop()

    loop_thread.run(main())


def test_a_request_whose_only_decode_worker_died_waits_for_its_replacement(loop_thread, tokenizer):
    async def body(cluster):
        dead = cluster.decodes[0]
        registry = cluster.router.registry
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            stream = client.generate_stream([4, 5, 6], max_tokens=20)
            chunks = [await stream.__anext__()]
            await dead.stop()                                  # the only decode worker is gone
            await until(lambda: not registry.healthy("decode"))
            replacement = await FakeWorker("decode", token_interval_s=0.01).start()
            try:
                await asyncio.sleep(0.5)                       # "the controller restarts it"
                registry.add("decode", replacement.address)
                chunks += [c async for c in stream]
            finally:
                await replacement.stop()
        assert [t for c in chunks for t in c.token_ids] == fake_completion([4, 5, 6], 20)
        assert replacement.state.seen
    run(loop_thread, tokenizer, body, decode_options={"token_interval_s": 0.05},
        failover_wait_s=30.0)


def test_a_probe_whose_channel_is_closed_by_a_concurrent_removal_is_a_miss_not_a_cancellation(loop_thread):
    """Many requests break at once and probe the same worker; the first probe that finds it gone
    removes it and closes its channel under the other probes' calls. Those must read as misses:
    a CancelledError escaping here used to end their HTTP streams mid-response."""
    from router.registry import WorkerRegistry

    async def main():
        dying = await FakeWorker("decode").start()
        registry = WorkerRegistry(heartbeat_timeout_s=5.0, max_missed=1)
        try:
            registry.add("decode", dying.address)
            assert await registry.poll(registry.get(dying.address))          # healthy
            dying.servicer.stats_delay_s, dying.servicer.stats_gone = 0.6, True
            first = asyncio.ensure_future(registry.probe(dying.address))
            await asyncio.sleep(0.2)
            second = asyncio.ensure_future(registry.probe(dying.address))  # in flight when `first` removes
            return await asyncio.gather(first, second, return_exceptions=True), registry.get(dying.address)
        finally:
            await registry.stop()
            await dying.stop(0)
    (first, second), left = loop_thread.run(main())
    assert first is False and second is False, (first, second)
    assert left is None


def test_a_worker_slower_than_the_heartbeat_timeout_is_busy_not_dead(loop_thread):
    """Liveness is not load: Stats answers that come late, poll after poll and on probes after
    failed requests, never remove a worker; only an answer saying it is gone does."""
    from router.registry import WorkerRegistry

    async def main():
        slow = await FakeWorker("decode").start()
        registry = WorkerRegistry(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.1, max_missed=1)
        removed = []
        registry.on_removed(removed.append)
        registry.start()
        try:
            registry.add("decode", slow.address)
            await registry.wait_healthy("decode", 1, 10)
            slow.servicer.stats_delay_s = 0.5                  # 5x the timeout, 10 intervals
            await asyncio.sleep(1.5)
            kept = [await registry.probe(slow.address) for _ in range(3)]
            still = [w.address for w in registry.healthy("decode")]
            slow.servicer.stats_delay_s, slow.servicer.stats_gone = 0.0, True
            await until(lambda: registry.get(slow.address) is None)
            return kept, still, removed
        finally:
            await registry.stop()
            await slow.stop(0)
    kept, still, removed = loop_thread.run(main())
    assert kept == [True, True, True]
    assert len(still) == 1
    assert [w.address for w in removed] == still


def test_router_stop_ends_every_task_it_started(loop_thread, tokenizer):
    async def main():
        before = set(asyncio.all_tasks())
        cluster = await start_fake_cluster(tokenizer)
        await cluster.router.stop()
        await cluster.router.stop()            # idempotent
        for worker in cluster.workers:
            await worker.stop()
        await asyncio.sleep(0.05)
        return {t for t in asyncio.all_tasks() if t not in before and not t.done()} - {asyncio.current_task()}
    assert loop_thread.run(main()) == set()


def test_largest_ids_round_trip_through_proto_and_msgpack():
    big = 2**63 - 1
    chunk = tandem_pb2.CompletionChunk(request_id="r" * 200, token_ids=[0, big],
                                       logprobs=[tandem_pb2.TokenLogprob(token_id=big)])
    back = tandem_pb2.CompletionChunk.FromString(chunk.SerializeToString())
    assert list(back.token_ids) == [0, big] and back.logprobs[0].token_id == big
    assert msgpack.unpackb(msgpack.packb(list(back.token_ids))) == [0, big]
    sampling = tandem_pb2.Sampling(seed=big, stop_token_ids=[big])
    assert tandem_pb2.Sampling.FromString(sampling.SerializeToString()).seed == big


class _LaggingDecode(FakeDecode):
    """Sends each request's tokens three per GenerateResponse, as a decode worker does when its
    stream lags three engine steps behind."""

    async def generate_one(self, request, context):
        params = request.sampling
        tokens = fake_completion(list(request.prompt_token_ids), params.max_tokens)
        self.state.seen.append(request.request_id)
        for start in range(0, len(tokens), 3):
            part = tokens[start:start + 3]
            response = worker_pb2.GenerateResponse(token_ids=part)
            if params.HasField("logprobs"):
                response.logprobs.extend(worker_pb2.TokenLogprobs(token_id=t, logprob=-0.25) for t in part)
            if start + 3 >= len(tokens):
                response.finish_reason, response.num_output_tokens = "length", len(tokens)
            yield response


def test_several_tokens_per_decode_message_keep_tokens_logprobs_usage_and_stop_strings(loop_thread, tokenizer):
    prompt = [21, 22, 23]
    expected = fake_completion(prompt, 10)
    text = tokenizer.decode(expected)
    stop = text[len(text) // 2:len(text) // 2 + 3]

    async def main():
        prefill = await FakeWorker("prefill").start()
        decode = FakeWorker("decode")
        decode.servicer = _LaggingDecode(decode.state)
        await decode.start()
        router = await Router(RouterConfig(model=MODEL, http_port=-1, grpc_port=0, prefill=(prefill.address,),
                                           decode=(decode.address,), heartbeat_interval_s=0.2), tokenizer).start()
        try:
            await router.registry.wait_healthy("decode", 1)
            await router.registry.wait_healthy("prefill", 1)
            async with AsyncTandemClient(router.grpc_address) as client:
                chunks = [c async for c in client.generate_stream(prompt, max_tokens=10, logprobs=1)]
                stopped = await client.generate(prompt, max_tokens=10, stop=[stop])
            return chunks, stopped
        finally:
            await router.stop()
            await prefill.stop()
            await decode.stop()

    chunks, stopped = loop_thread.run(main())
    assert [t for c in chunks for t in c.token_ids] == expected
    assert [lp.token_id for c in chunks for lp in c.logprobs] == expected
    assert "".join(c.text for c in chunks) == text
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 10
    assert len(chunks) <= 4                          # a chunk per message, never one per token
    assert stopped.finish_reason == "stop" and stopped.text == text[:text.index(stop)]


class _ScriptedPrefill(FakePrefill):
    """Answers every Submit on its session with ``error_code`` (never, when None)."""

    def __init__(self, state, error_code: grpc.StatusCode | None) -> None:
        super().__init__(state)
        self.error_code = error_code

    async def Session(self, request_iterator, context):
        async for message in request_iterator:
            self.state.seen.extend(r.request_id for r in message.submit)
            self.state.aborted.extend(message.abort)
            if self.error_code is not None and message.submit:
                yield worker_pb2.PrefillSessionResponse(results=[worker_pb2.SubmitResponse(
                    request_id=r.request_id, error_code=self.error_code.value[0], error="scripted refusal")
                    for r in message.submit])


async def _cluster_with_prefill(tokenizer, error_code, **router_options):
    prefill = FakeWorker("prefill")
    prefill.servicer = _ScriptedPrefill(prefill.state, error_code)
    await prefill.start()
    decode = await FakeWorker("decode", token_interval_s=0.02).start()
    config = RouterConfig(model=MODEL, http_port=0, grpc_port=0, prefill=(prefill.address,),
                          decode=(decode.address,), heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0,
                          **router_options)
    router = await Router(config, tokenizer).start()
    await router.registry.wait_healthy("prefill", 1)
    await router.registry.wait_healthy("decode", 1)
    return router, prefill, decode


def test_a_submit_the_prefill_worker_refuses_fails_the_request_with_its_status(loop_thread, tokenizer):
    """The Submit's answer comes back on P's session: a refusal that is not transient ends the
    request with the worker's status, and the request is aborted at D."""
    async def main():
        router, prefill, decode = await _cluster_with_prefill(tokenizer, grpc.StatusCode.INVALID_ARGUMENT,
                                                              local_prefill_max_tokens=0)
        try:
            async with AsyncTandemClient(router.grpc_address) as client:
                with pytest.raises(InvalidArgument, match="scripted refusal"):
                    await client.generate([1, 2, 3], max_tokens=50)
            await until(lambda: not decode.state.active)
            assert decode.state.aborted == prefill.state.seen and len(prefill.state.seen) == 1
            assert router.dispatcher.num_waiting == 0
            assert [w.num_inflight for w in router.registry.all()] == [0, 0]
        finally:
            await router.stop()
            await prefill.stop()
            await decode.stop()
    loop_thread.run(main(), 60)


def test_a_submit_never_answered_times_out_and_the_request_fails_instead_of_hanging(loop_thread, tokenizer):
    """A prefill worker alive (it answers heartbeats) that never answers a Submit: after
    rpc_timeout_s the attempt is given up, retried once, and the request fails; nothing is left
    running at D."""
    async def main():
        router, prefill, decode = await _cluster_with_prefill(tokenizer, None, local_prefill_max_tokens=0,
                                                              rpc_timeout_s=0.3)
        try:
            async with AsyncTandemClient(router.grpc_address) as client:
                with pytest.raises(TandemError, match="DEADLINE_EXCEEDED"):
                    await asyncio.wait_for(client.generate([1, 2, 3], max_tokens=200), 20)
            await until(lambda: not decode.state.active)
            assert len(prefill.state.seen) == 2   # the first attempt and its one retry
            assert router.dispatcher.num_waiting == 0
            assert not router.dispatcher._background
        finally:
            await router.stop()
            await prefill.stop()
            await decode.stop()
    loop_thread.run(main(), 60)


def test_two_decode_workers_killed_in_turn_under_one_stream_are_not_a_poison_request(loop_thread, tokenizer):
    """A killed decode worker breaks the stream (UNAVAILABLE) before the registry knows it is
    gone; the probe after the break removes it. Two such kills in a row fail the same way, and
    that is the workers' fault, not the request's: the stream completes on the third worker."""
    async def body(cluster):
        prompt = [21, 22, 23]
        tokens: list[int] = []
        killed = []
        async with AsyncTandemClient(cluster.router.grpc_address) as client:
            async for chunk in client.generate_stream(prompt, max_tokens=60, temperature=0):
                tokens += chunk.token_ids
                if len(tokens) >= 5 * (len(killed) + 1) and len(killed) < 2:
                    serving = [d for d in cluster.decodes if d.server is not None and d.state.active]
                    assert len(serving) == 1
                    killed.append(serving[0].address)
                    await serving[0].stop()
        assert len(killed) == 2
        assert tokens == fake_completion(prompt, 60)
    run(loop_thread, tokenizer, body, num_decode=3, decode_options={"token_interval_s": 0.02})


def test_a_router_started_over_running_workers_serves_its_first_request(loop_thread, tokenizer):
    """A restarted router is given the running workers (deploy/controller.py); it hears from
    each once before its ports open, so the first request is served, not refused with "no
    decode worker is available" while the first heartbeat is on its way (a slow Stats here)."""
    async def main():
        prefill = await FakeWorker("prefill").start()
        decode = await FakeWorker("decode").start()
        decode.servicer.stats_delay_s = 0.5
        router = await Router(RouterConfig(model=MODEL, http_port=-1, grpc_port=0, prefill=(prefill.address,),
                                           decode=(decode.address,), heartbeat_interval_s=0.2,
                                           heartbeat_timeout_s=2.0), tokenizer).start()
        try:
            async with AsyncTandemClient(router.grpc_address) as client:
                return await client.generate([4, 5, 6], max_tokens=3)
        finally:
            await router.stop()
            await prefill.stop()
            await decode.stop()
    out = loop_thread.run(main(), 30)
    assert out.token_ids == fake_completion([4, 5, 6], 3)
