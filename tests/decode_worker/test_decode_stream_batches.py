"""Stream events leave the decode engine thread once per step: DecodeLoop hands each step's events
for every running request to ``deliver`` in one call, the servicer crosses to asyncio once per
batch, and a session that lags sends each request's waiting steps' tokens in one GenerateResponse.
The servicer runs in-process on port 0 over a stand-in engine thread; the loop is the PD twin."""
from __future__ import annotations

import asyncio
import queue
import threading
from types import SimpleNamespace

import grpc

from decode_worker.servicer import DecodeServicer, PrefillClients
from decode_worker.worker import DecodeJob, StreamEvent
from engine.config import SamplingParams
from prefill_worker.worker import PrefillJob
from protos.streams import refusal
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

VOCAB = 100


class _EngineStandIn:
    """What the servicer needs of DecodeLoop; the test plays the engine thread through ``deliver``."""

    def __init__(self) -> None:
        self.engine = SimpleNamespace(arch=SimpleNamespace(vocab_size=VOCAB), max_model_len=64)
        self.jobs: dict = {}
        self.deliver = None          # the servicer's deliver, as DecodeLoop is given it
        self.alive = True

    async def run(self, fn):
        return fn()

    def call(self, fn) -> None:
        fn()

    def add(self, job) -> None:
        self.jobs[job.request_id] = job

    def abort(self, request_id: str) -> bool:
        return self.jobs.pop(request_id, None) is not None


def test_one_thread_hop_per_batch_and_a_lagging_stream_gets_its_steps_in_one_message():
    async def main():
        engine = _EngineStandIn()
        servicer = DecodeServicer(PrefillClients())
        servicer.attach(engine)
        engine.deliver = servicer.deliver
        server = grpc.aio.server()
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        loop = asyncio.get_running_loop()
        hops = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: (hops.append(args[0]), original(*args))[1]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                session = worker_pb2_grpc.DecodeWorkerStub(channel).Session()

                def request(rid: str, **sampling) -> worker_pb2.GenerateRequest:
                    return worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3], prefill_address="p:1",
                                                      sampling=worker_pb2.SamplingParams(max_tokens=3, **sampling))
                await session.write(worker_pb2.DecodeSessionRequest(
                    generate=[request(rid, **({"logprobs": 1} if rid == "a" else {})) for rid in "abc"]))
                await session.done_writing()   # the worker ends the stream once all three ended
                while len(engine.jobs) < 3:
                    await asyncio.sleep(0.01)
                a, b, c = (engine.jobs[rid].sink for rid in "abc")
                steps = [[(a, StreamEvent([5], [{5: -0.5, 6: -1.0}])), (b, StreamEvent([50])), (c, StreamEvent([9]))],
                         [(a, StreamEvent([6], [{6: -0.25}])), (b, StreamEvent([51])),
                          (c, StreamEvent(error="KV transfer from the prefill worker failed: lease expired"))],
                         [(a, StreamEvent([7], [{7: -0.125}], finish_reason="length", num_prompt_tokens=3,
                                          num_output_tokens=3, num_cached_tokens=1)),
                          (b, StreamEvent([52], finish_reason="length", num_prompt_tokens=3, num_output_tokens=3))]]

                def engine_thread() -> None:
                    # Three steps land before asyncio runs any handler: every stream lags.
                    for batch in steps:
                        engine.deliver(batch)
                loop.call_soon(engine_thread)
                responses = {rid: [] for rid in "abc"}
                error = None
                async for message in session:
                    for output in message.outputs:
                        responses[output.request_id].append(output)
                        if output.error_code:
                            failure = refusal(output.error_code, output.error)
                            error = (output.request_id, failure.code(), failure.details())
                return responses, error, hops
        finally:
            loop.call_soon_threadsafe = original
            await server.stop(None)
            await servicer.prefill.close()

    responses, error, hops = asyncio.run(main())
    a, b, c = (responses[rid] for rid in "abc")
    assert [list(r.token_ids) for r in a] == [[5, 6, 7]]            # three steps, one message
    assert a[0].finish_reason == "length" and (a[0].num_output_tokens, a[0].num_cached_tokens) == (3, 1)
    assert [(lp.token_id, lp.logprob, list(lp.top_token_ids)) for lp in a[0].logprobs] == \
           [(5, -0.5, [5]), (6, -0.25, [6]), (7, -0.125, [7])]
    assert [list(r.token_ids) for r in b] == [[50, 51, 52]] and b[0].finish_reason == "length"
    assert [list(r.token_ids) for r in c] == [[9]]                  # the token before the error is kept
    assert error == ("c", grpc.StatusCode.UNAVAILABLE, "KV transfer from the prefill worker failed: lease expired")
    assert len(hops) == 3                                          # one cross-thread call per step


def test_the_decode_loop_delivers_each_step_for_every_running_request_in_one_call(pd_twin):
    prefill, decode = pd_twin()
    batches: list[list[tuple]] = []
    lock = threading.Lock()

    def deliver(batch) -> None:       # engine thread
        with lock:
            batches.append(list(batch))
        for sink, event in batch:
            sink(event)
    decode.deliver = deliver
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    streams = {}
    for i in range(4):
        rid, prompt, events = f"batch-{i}", [100 + 7 * i + j for j in range(5 + i)], queue.SimpleQueue()
        streams[rid] = events
        decode.call(lambda j=DecodeJob(rid, prompt, params, "in-process", events.put): decode.add(j))
        prefill.call(lambda j=PrefillJob(rid, prompt, params, "in-process"): prefill.submit(j))
    for rid, events in streams.items():
        tokens = []
        while True:
            event = events.get(timeout=60)
            assert event.error is None, event.error
            tokens += event.token_ids
            if event.finish_reason is not None:
                break
        assert len(tokens) == 12 and event.finish_reason == "length", rid
    with lock:
        widest = max(len({id(sink) for sink, _ in batch}) for batch in batches)
        num_events = sum(len(batch) for batch in batches)
    assert widest == 4                    # a step with all four running reached them in one call
    assert len(batches) < num_events
