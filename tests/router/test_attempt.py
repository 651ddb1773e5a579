"""An attempt's life at the router (router/dispatch.py's module docstring), on hand-built
attempts: its outcome is set once, a cut counts only on a stream still open, and its workers'
load is held and released through the registry exactly once."""
from __future__ import annotations

import asyncio

from protos.tandem.v1 import worker_pb2
from router import registry as registry_module
from router.dispatch import Attempt, Break, Dispatcher, Outcome, Stage
from router.policies import make_policy
from router.registry import WorkerRegistry, WorkerState, cancel_requested
from router.session import SessionCall


class _Session:
    """What a SessionCall asks of its DecodeSession: to cancel the request there."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def _cancel(self, call: SessionCall) -> None:
        self.cancelled.append(call.request_id)


def _attempt(session: _Session, prefill: WorkerState | None = None) -> Attempt:
    decode = WorkerState("decode", "d:1", channel=None, stub=None)
    call = SessionCall(session, "r")  # type: ignore[arg-type]
    if prefill is None:
        return Attempt("r", None, decode, call, None, Stage.PREFILLED)
    return Attempt("r", prefill, decode, call, worker_pb2.SubmitRequest(request_id="r"), Stage.PREFILLING)


def test_the_first_conclusion_decides():
    attempt = _attempt(_Session())
    brk = Break("decode", "decode stream: UNAVAILABLE")
    assert attempt.conclude(Outcome.BROKEN, brk)
    assert not attempt.conclude(Outcome.ABANDONED)
    assert not attempt.conclude(Outcome.FINISHED)
    assert (attempt.outcome, attempt.broken) == (Outcome.BROKEN, brk)


def test_a_cut_breaks_an_open_stream_and_cancels_it_at_the_decode_worker():
    session = _Session()
    attempt = _attempt(session)
    first = Break("decode", "worker d:1 was removed", lost="d:1")
    Dispatcher._cut(attempt, first)
    Dispatcher._cut(attempt, Break("prefill", "Submit to p:1: UNAVAILABLE"))
    assert (attempt.outcome, attempt.broken) == (Outcome.BROKEN, first)
    assert session.cancelled == ["r"]


def test_a_cut_after_the_finish_arrived_leaves_the_outcome_to_the_stream():
    session = _Session()
    attempt = _attempt(session)
    attempt.call._put(worker_pb2.GenerateResponse(token_ids=[5], finish_reason="stop"))
    Dispatcher._cut(attempt, Break("decode", "worker d:1 was removed", lost="d:1"))
    assert attempt.outcome is None and attempt.broken is None and session.cancelled == []
    responses = asyncio.run(attempt.call.take())
    assert [(list(r.token_ids), r.finish_reason) for r in responses] == [([5], "stop")]


def test_the_registry_counts_a_workers_load():
    worker = WorkerState("decode", "d:1", channel=None, stub=None)
    WorkerRegistry.hold(worker)
    WorkerRegistry.hold(worker)
    WorkerRegistry.release(worker)
    assert (worker.num_inflight, worker.num_requests) == (1, 2)


def test_leaving_prefilling_releases_the_prefill_worker_once_and_the_end_the_decode_worker():
    dispatcher = Dispatcher(WorkerRegistry(), make_policy("least_load"), make_policy("least_load"))
    prefill = WorkerState("prefill", "p:1", channel=None, stub=None)
    attempt = _attempt(_Session(), prefill)
    dispatcher._hold(attempt, prefill)
    dispatcher._hold(attempt, attempt.decode)
    dispatcher._reach(attempt, Stage.STREAMING)
    dispatcher._reach(attempt, Stage.PREFILLED)            # never back
    assert attempt.stage is Stage.STREAMING
    assert (prefill.num_inflight, attempt.decode.num_inflight) == (0, 1)
    assert attempt.conclude(Outcome.FINISHED)
    dispatcher._end(attempt)
    assert (prefill.num_inflight, prefill.num_requests) == (0, 1)
    assert (attempt.decode.num_inflight, attempt.decode.num_requests) == (0, 1)
    assert dispatcher._attempts == {"p:1": set(), "d:1": set()}


def test_cancel_requested_tells_the_tasks_own_cancel_from_a_closed_call():
    async def main() -> tuple[bool | None, bool | None]:
        async def closed_under_us() -> bool | None:
            inner = asyncio.get_running_loop().create_future()
            inner.cancel()                   # as a closed channel cancels the call awaited
            try:
                await inner
            except asyncio.CancelledError:
                return cancel_requested()
            return None

        async def cancelled() -> bool | None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return cancel_requested()
            return None

        task = asyncio.ensure_future(cancelled())
        await asyncio.sleep(0)
        task.cancel()
        return await closed_under_us(), await task

    assert asyncio.run(main()) == (False, True)


def test_cancel_requested_is_unknown_on_a_python_without_task_cancelling(monkeypatch):
    """Python 3.10 (the GPU cluster image's) has no Task.cancelling: calling it there raised
    AttributeError inside the failover path."""
    class Python310Task:
        pass

    monkeypatch.setattr(registry_module.asyncio, "current_task", lambda: Python310Task())
    assert cancel_requested() is None
