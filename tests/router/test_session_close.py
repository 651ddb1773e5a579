"""A worker's session is closed (the registry removed the worker) while its stream is still
opening: the close returns and the request on it fails UNAVAILABLE.

grpc's ``write`` on a stream first waits until the stream's headers went out; a stream cancelled
before its connection came up (its peer just killed, or frozen) never sends them and never wakes
that wait. ``SessionStream.close`` waited for its writer, so it hung, and with it
``WorkerRegistry.remove`` and whoever awaited that. In the 64-worker run (issue 28,
docs/performance.md "The 64-worker run") one request waited for its first token until the client
gave up at 600 s; a request whose decode stream broke probes its worker and, finding it gone,
removes it (``Dispatcher._judge``), so if another request's stream to that worker was still
opening, the prober's failover never came back.
"""
from __future__ import annotations

import asyncio
import socket

import grpc

from protos.tandem.v1 import worker_pb2, worker_pb2_grpc
from router.session import DecodeSession, PrefillSession

CLOSE_TIMEOUT_S = 5.0


def _closed_port() -> int:
    """A port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _close_while_opening(session_cls, address: str, start) -> list[grpc.StatusCode]:
    """Start one request on a new session to ``address`` and close it in the same turn of the loop;
    the codes the request failed with."""
    channel = grpc.aio.insecure_channel(address)
    stub_cls = worker_pb2_grpc.DecodeWorkerStub if session_cls is DecodeSession else worker_pb2_grpc.PrefillWorkerStub
    session = session_cls(stub_cls(channel), address)
    try:
        failed = start(session)
        await asyncio.wait_for(session.close(), CLOSE_TIMEOUT_S)
        return [await failed]
    finally:
        await channel.close()


def _generate(session: DecodeSession) -> asyncio.Future:
    call = session.generate(worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1],
                                                       prefill_address="127.0.0.1:1"))

    async def code() -> grpc.StatusCode:
        try:
            await call.take()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        raise AssertionError("the request did not fail")
    return asyncio.ensure_future(code())


def _submit(session: PrefillSession) -> asyncio.Future:
    answer = session.submit(worker_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1],
                                                     decode_address="127.0.0.1:1"), 30.0)

    async def code() -> grpc.StatusCode:
        try:
            await answer
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        raise AssertionError("the request did not fail")
    return asyncio.ensure_future(code())


def test_a_session_closes_while_its_stream_to_a_dead_or_frozen_worker_is_opening(loop_thread):
    async def body() -> None:
        frozen = socket.socket()   # accepts connections into its backlog and never speaks: a frozen process
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)
        try:
            for address in (f"127.0.0.1:{_closed_port()}", f"127.0.0.1:{frozen.getsockname()[1]}"):
                for session_cls, start in ((DecodeSession, _generate), (PrefillSession, _submit)):
                    assert await _close_while_opening(session_cls, address, start) == [grpc.StatusCode.UNAVAILABLE]
        finally:
            frozen.close()
    loop_thread.run(body(), timeout_s=60)
