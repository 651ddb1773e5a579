"""gRPC servicer of the prefill worker: converts protos, validates, calls the engine thread.

Submits come only on the router's ``Session`` stream (worker.proto), many to a message; each is
queued through ``_submit`` on the engine thread and answered on the stream.

``SetDestination`` is also the model handshake: the decode worker sends its fingerprint
(engine/fingerprint.py) and gets this worker's back; a destination of another model or
KV layout is refused with FAILED_PRECONDITION naming both, and the request is dropped here.
"""
from __future__ import annotations

import asyncio
from functools import partial

import grpc

from engine.fingerprint import check_peer
from prefill_worker.worker import AbortedBeforeSubmit, Destination, PrefillJob, PrefillLoop
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc
from worker.convert import check_request, sampling_from_proto
from worker.session import SessionState

MAX_DESCRIPTOR_BYTES = 1 << 16


def _refused(request_id: str, code: grpc.StatusCode, message: str) -> worker_pb2.SubmitResponse:
    return worker_pb2.SubmitResponse(request_id=request_id, error_code=code.value[0], error=message)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, loop: PrefillLoop, fingerprint: str) -> None:
        self.loop = loop
        self.fingerprint = fingerprint
        self.vocab_size = loop.engine.arch.vocab_size
        self.max_model_len = loop.engine.max_model_len

    def _job(self, request: worker_pb2.SubmitRequest) -> PrefillJob:
        """The job for ``request``; ValueError (INVALID_ARGUMENT) when it is malformed."""
        prompt = list(request.prompt_token_ids)
        check_request(request.request_id, prompt, self.vocab_size, self.max_model_len)
        return PrefillJob(request.request_id, prompt, sampling_from_proto(request.sampling), request.decode_address)

    def _submit(self, job: PrefillJob) -> worker_pb2.SubmitResponse:
        """Queue ``job`` (engine thread): its answer, with the refusal's status when refused."""
        try:
            cached = self.loop.submit(job)
        except KeyError as exc:
            return _refused(job.request_id, grpc.StatusCode.ALREADY_EXISTS, str(exc.args[0]))
        except AbortedBeforeSubmit as exc:
            return _refused(job.request_id, grpc.StatusCode.ABORTED, str(exc))
        except ValueError as exc:
            return _refused(job.request_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.SubmitResponse(request_id=job.request_id, num_cached_tokens=cached)

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        """Submits and aborts on one stream (the router's data plane): see worker.proto's
        PrefillSessionRequest. Every submit gets its SubmitResponse on the stream, in one message
        with the others answered in the same engine-thread turn; the requests outlive the stream
        (the decode worker aborts here what it stops)."""
        aio_loop = asyncio.get_running_loop()
        answers: list[worker_pb2.SubmitResponse] = []
        state = SessionState()
        outstanding = 0      # submits queued for the engine thread, not answered yet

        def answer(responses: list[worker_pb2.SubmitResponse], queued: int = 0) -> None:   # asyncio thread
            nonlocal outstanding
            answers.extend(responses)
            outstanding -= queued
            state.wake()

        def submit_all(jobs: list[PrefillJob]) -> None:   # engine thread
            responses = [self._submit(job) for job in jobs]
            aio_loop.call_soon_threadsafe(answer, responses, len(jobs))

        def refuse_compiled(request_id: str, why: str) -> None:   # asyncio thread: its grammar does not compile
            answer([_refused(request_id, grpc.StatusCode.INVALID_ARGUMENT, why)], 1)

        def handle(message: worker_pb2.PrefillSessionRequest) -> None:
            nonlocal outstanding
            jobs = []
            for request in message.submit:
                rid = request.request_id
                try:
                    job = self._job(request)
                except ValueError as exc:
                    answer([_refused(rid, grpc.StatusCode.INVALID_ARGUMENT, str(exc))])
                    continue
                if not self.loop.alive:
                    answer([_refused(rid, grpc.StatusCode.UNAVAILABLE, "the engine thread is not running")])
                    continue
                outstanding += 1
                if job.params.structured is None:
                    jobs.append(job)
                else:
                    state.compile_then(self.loop.engine.compile_grammar, job.params.structured,
                                       partial(self.loop.call, partial(submit_all, [job])),
                                       partial(refuse_compiled, rid))
            if jobs:
                self.loop.call(lambda: submit_all(jobs))
            for rid in message.abort:
                self.loop.call(partial(self.loop.abort, rid))

        state.read(request_iterator, handle)
        try:
            while state.reading or outstanding or answers:
                while not answers and (state.reading or outstanding):
                    await state.wait()
                if answers:
                    response = worker_pb2.PrefillSessionResponse(results=answers)
                    answers.clear()
                    yield response
                state.check()
        finally:
            state.close()

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
