"""gRPC servicer of the prefill worker: converts protos, validates, calls the engine thread.

``SetDestination`` is also the model handshake: the decode worker sends its fingerprint
(engine/serving/fingerprint.py) and gets this worker's back; a destination of another model or
KV layout is refused with FAILED_PRECONDITION naming both, and the request is dropped here.
"""
from __future__ import annotations

import asyncio

import grpc

from engine.serving.convert import check_request, sampling_from_proto
from engine.serving.fingerprint import check_peer
from prefill_worker.worker import AbortedBeforeSubmit, Destination, PrefillJob, PrefillLoop
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

MAX_DESCRIPTOR_BYTES = 1 << 16


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, loop: PrefillLoop, fingerprint: str) -> None:
        self.loop = loop
        self.fingerprint = fingerprint
        self.vocab_size = loop.engine.arch.vocab_size
        self.max_model_len = loop.engine.max_model_len

    async def Submit(self, request: worker_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        try:
            prompt = list(request.prompt_token_ids)
            check_request(request.request_id, prompt, self.vocab_size, self.max_model_len)
            params = sampling_from_proto(request.sampling)
            if params.structured is not None:   # compiled off the engine thread; a bad one is refused here
                await asyncio.to_thread(self.loop.engine.grammars.compile, params.structured)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        job = PrefillJob(request.request_id, prompt, params, request.decode_address)
        try:
            cached = await self.loop.run(lambda: self.loop.submit(job))
        except KeyError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc.args[0]))
        except AbortedBeforeSubmit as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.SubmitResponse(num_cached_tokens=cached)

    async def SetDestination(self, request: worker_pb2.SetDestinationRequest, context: grpc.aio.ServicerContext):
        if not request.request_id or not request.block_ids or not request.region_descriptor:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request_id, block_ids and region_descriptor are all required")
        if len(request.region_descriptor) > MAX_DESCRIPTOR_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"region_descriptor is {len(request.region_descriptor)} bytes, "
                                f"more than {MAX_DESCRIPTOR_BYTES}")
        if any(b < 0 for b in request.block_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "block_ids must be >= 0")
        refused = check_peer(self.fingerprint, request.fingerprint, "prefill", "decode")
        if refused:
            # Its KV could never be read by that decode worker: stop computing it.
            await self.loop.run(lambda: self.loop.abort(request.request_id))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused)
        destination = Destination(list(request.block_ids), bytes(request.region_descriptor))
        try:
            await self.loop.run(lambda: self.loop.set_destination(request.request_id, destination))
        except ValueError as exc:  # includes kvtransfer.LayoutMismatchError
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.SetDestinationResponse(fingerprint=self.fingerprint)

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
        return worker_pb2.StatsResponse(**snapshot, fingerprint=self.fingerprint)
