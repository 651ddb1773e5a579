"""gRPC servicer of the decode worker: the Generate stream, Abort and Stats.

Also the decode side's client of the prefill workers: it tells a prefill worker where to
write (SetDestination) and aborts there when a stream is cancelled.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from decode_worker.worker import DecodeJob, DecodeLoop, StreamEvent
from engine.serving.convert import check_request, logprobs_to_proto, sampling_from_proto
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillClients:
    """One aio channel per prefill worker address, used from the asyncio thread."""

    def __init__(self) -> None:
        self._stubs: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address)
            self._channels.append(channel)
            stub = self._stubs[address] = worker_pb2_grpc.PrefillWorkerStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, prefill: PrefillClients, rpc_timeout_s: float = 30.0) -> None:
        self.prefill = prefill
        self.rpc_timeout_s = rpc_timeout_s
        self.aio_loop: asyncio.AbstractEventLoop | None = None  # set by the first Generate

    def attach(self, loop: DecodeLoop) -> None:
        """Wire the engine thread (built after this servicer, since it calls send_destination)."""
        self.loop = loop
        self.vocab_size = loop.engine.runner.arch.vocab_size
        self.max_model_len = loop.engine.max_model_len

    # Called on the engine thread when blocks are reserved.
    def send_destination(self, job: DecodeJob, descriptor: bytes) -> None:
        asyncio.run_coroutine_threadsafe(self._send_destination(job, descriptor), self.aio_loop)

    async def _send_destination(self, job: DecodeJob, descriptor: bytes) -> None:
        request = worker_pb2.SetDestinationRequest(request_id=job.request_id, block_ids=job.transfer_block_ids,
                                                   region_descriptor=descriptor)
        try:
            await self.prefill.stub(job.prefill_address).SetDestination(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                # The prefill worker may be gone: keep the reservation, so the router can move the
                # request to another prefill worker (SetPrefill); the lease is the backstop.
                logger.warning("prefill worker %s unreachable for request_id=%s (%s); keeping the reservation",
                               job.prefill_address, job.request_id, exc.code().name)
                return
            reason = f"prefill worker {job.prefill_address} refused the destination: {exc.code().name}: {exc.details()}"
            self.loop.call(lambda: self.loop.fail(job.request_id, reason))

    async def _abort_prefill(self, address: str, request_id: str) -> None:
        try:
            await self.prefill.stub(address).Abort(worker_pb2.AbortRequest(request_id=request_id),
                                                   timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError:
            pass  # already done there, or the worker is gone: nothing left to stop

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            prompt = list(request.prompt_token_ids)
            check_request(request.request_id, prompt, self.vocab_size, self.max_model_len)
            params = sampling_from_proto(request.sampling)
            if not request.prefill_address:
                raise ValueError("prefill_address is empty: name the prefill worker computing this prompt")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        aio_loop = self.aio_loop = asyncio.get_running_loop()

        def sink(event: StreamEvent) -> None:  # engine thread
            try:
                aio_loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:
                pass  # the server is shutting down; nobody reads this stream any more

        job = DecodeJob(request.request_id, prompt, params, request.prefill_address, sink=sink)
        try:
            await self.loop.run(lambda: self.loop.add(job))
        except KeyError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc.args[0]))
        finished = False
        k = params.logprobs or 0
        try:
            while True:
                event = await events.get()
                if event.error is not None:
                    finished = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, event.error)
                response = worker_pb2.GenerateResponse(token_ids=event.token_ids)
                if params.logprobs is not None:
                    response.logprobs.extend(logprobs_to_proto(t, e, k) for t, e in zip(event.token_ids, event.logprobs))
                if event.finish_reason is not None:
                    finished = True
                    response.finish_reason = event.finish_reason
                    response.num_prompt_tokens = event.num_prompt_tokens
                    response.num_output_tokens = event.num_output_tokens
                    response.num_cached_tokens = event.num_cached_tokens
                yield response
                if finished:
                    return
        finally:
            if not finished:  # the client went away: free everything for this request now
                request_id = request.request_id
                self.loop.call(lambda: self.loop.abort(request_id))
                aio_loop.create_task(self._abort_prefill(job.prefill_address, request_id))

    async def SetPrefill(self, request: worker_pb2.SetPrefillRequest, context: grpc.aio.ServicerContext):
        if not request.request_id or not request.prefill_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id and prefill_address are required")
        moved = await self.loop.run(lambda: self.loop.set_prefill(request.request_id, request.prefill_address))
        if not moved:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request_id={request.request_id!r} is not waiting for its KV here")
        return worker_pb2.SetPrefillResponse()

    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        found = await self.loop.run(lambda: self.loop.abort(request.request_id))
        if not found:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id={request.request_id!r} is not known here")
        return worker_pb2.AbortResponse()

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        try:
            snapshot = self.loop.snapshot()   # never waits on the engine thread (liveness != load)
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return worker_pb2.StatsResponse(**snapshot)
