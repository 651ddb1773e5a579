"""A drain with a deadline (``RouterConfig.drain_move_after_s``, issue 28): the streams a draining
decode worker still runs then resume on another pair, as a failover does, so a scale-down
ends at the deadline, not when its longest stream ends."""
from __future__ import annotations

import time

import grpc
import pytest

from protos.auth import SecretStub, require_secret
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from router.config import RouterConfig
from router.server import Router
from tandem_client import AsyncTandemClient
from tests.router.fake_workers import FakeWorker, fake_completion

MODEL = "smollm2-135m-instruct"
PROMPT = [9, 8, 7]
NUM_TOKENS = 60      # 3 s at 50 ms a token: far longer than the deadline


async def _drain_a_streaming_worker(tokenizer, drain_move_after_s: float | None) -> dict:
    """One stream on ``first``; ``first`` drained after its first token. What became of it."""
    prefill = await FakeWorker("prefill").start()
    first = await FakeWorker("decode", token_interval_s=0.05).start()
    second = await FakeWorker("decode", token_interval_s=0.05).start()
    router = await Router(RouterConfig(model=MODEL, http_port=-1, grpc_port=0, prefill=(prefill.address,),
                                       decode=(first.address, second.address), heartbeat_interval_s=0.2,
                                       drain_move_after_s=drain_move_after_s), tokenizer).start()
    try:
        registry = router.registry
        await registry.wait_healthy("decode", 2)
        await registry.wait_healthy("prefill", 1)
        registry.get(second.address).num_inflight = 1000           # least_load picks `first`
        async with AsyncTandemClient(router.grpc_address) as client, \
                grpc.aio.insecure_channel(router.grpc_address) as channel:
            stream = client.generate_stream(PROMPT, max_tokens=NUM_TOKENS, temperature=0)
            chunks = [await stream.__anext__()]                    # streaming on `first`
            admin = SecretStub(admin_pb2_grpc.AdminStub(channel), require_secret("the test"))
            drained_at = time.monotonic()
            assert (await admin.DrainWorkers(admin_pb2.DrainWorkersRequest(addresses=[first.address]))).found
            registry.get(second.address).num_inflight -= 1000
            emptied_s = None
            async for chunk in stream:
                chunks.append(chunk)
                if emptied_s is None and registry.get(first.address).num_inflight == 0:
                    emptied_s = time.monotonic() - drained_at
            if emptied_s is None and registry.get(first.address).num_inflight == 0:
                emptied_s = time.monotonic() - drained_at
        return {"tokens": [t for c in chunks for t in c.token_ids], "emptied_s": emptied_s,
                "first": list(first.state.seen), "second": list(second.state.seen),
                "aborted_at_first": list(first.state.aborted)}
    finally:
        await router.stop()
        for worker in (prefill, first, second):
            await worker.stop()


def test_a_stream_still_running_at_the_drain_deadline_resumes_on_another_worker(loop_thread, tokenizer):
    out = loop_thread.run(_drain_a_streaming_worker(tokenizer, drain_move_after_s=0.3))
    assert out["tokens"] == fake_completion(PROMPT, NUM_TOKENS)       # nothing lost or repeated
    (moved,) = out["first"]
    assert out["second"] == [f"{moved}.retry1"] and moved in out["aborted_at_first"]
    assert out["emptied_s"] is not None and out["emptied_s"] < 1.5     # the deadline, not the stream's 3 s


def test_without_a_deadline_the_stream_finishes_on_the_draining_worker(loop_thread, tokenizer):
    out = loop_thread.run(_drain_a_streaming_worker(tokenizer, drain_move_after_s=None))
    assert out["tokens"] == fake_completion(PROMPT, NUM_TOKENS)
    assert len(out["first"]) == 1 and out["second"] == [] and out["aborted_at_first"] == []
    assert out["emptied_s"] is None or out["emptied_s"] > 2.0


def test_the_deadline_is_checked():
    with pytest.raises(ValueError, match="drain_move_after_s must be >= 0"):
        RouterConfig(model=MODEL, drain_move_after_s=-1.0)
    assert RouterConfig(model=MODEL, drain_move_after_s=0.0).drain_move_after_s == 0.0
