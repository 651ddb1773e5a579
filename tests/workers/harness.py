"""Helpers for the worker-process tests: start a prefill/decode worker, drive requests, poll, and
compare a pair's output with the colocated LLM's.

Runs in the pytest process. Workers are real ``python -m prefill_worker`` / ``decode_worker``
processes; the client side uses the sync ``grpc`` API and threads, like a router would use
the aio one. Requests go where the router sends them, on the workers' Session streams: here one
stream per request (``open_generate``, ``submit``), read as that request's own call would be.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from deploy.launch import WorkerProcess, WorkerStartError
from engine.config import SamplingParams
from protos.auth import SecretClientInterceptor, require_secret
from protos.streams import refusal
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.models import random_prompt

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0     # two workers and pytest share 2 cores; model load is ~2-10 s
RPC_TIMEOUT_S = 60.0
BLOCK_SIZE = 16
POOL_BLOCKS = 256
REFERENCE_BLOCKS = 512
# Worker logprobs against the colocated LLM's, float32 on both sides: at most 3e-6 apart measured
# (batches differ between the two, so the reductions do too).
LOGPROB_ABS_TOL = 2e-5


class Worker(WorkerProcess):
    """A worker process plus a sync channel to it, its stderr log, and Stats.

    ``wait=False`` returns at once (start the ranks of a TP replica together, then
    ``wait_ready`` each); a TP follower rank has no gRPC, so no channel."""

    def __init__(self, role: str, model: Path, flags: list[str], log_dir: Path, name: str,
                 wait: bool = True) -> None:
        self.stderr_path = log_dir / f"{name}.stderr"
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - the child writes it until stop()
        self.channel: grpc.Channel | None = None
        super().__init__(role, ["--model", str(model), "--port", "0", "--metrics-port", "0", "--dtype",
                                "float32", "--device", "cpu", "--num-threads", "1", *flags],
                         stderr=self._stderr, env={"OMP_NUM_THREADS": "1"}, start_timeout_s=START_TIMEOUT_S,
                         wait=wait)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        try:
            info = super().wait_ready(timeout_s)
        except WorkerStartError as exc:
            self._stderr.close()
            raise WorkerStartError(f"{exc}\nstderr:\n{self.stderr()}") from None
        if info.get("grpc"):
            # Every call carries the session's cluster secret (tests/conftest.py), as the router's do.
            self.channel = grpc.intercept_channel(grpc.insecure_channel(self.grpc),
                                                  SecretClientInterceptor(require_secret("the test harness")))
        return info

    @property
    def prefill_stub(self) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self.channel)

    @property
    def decode_stub(self) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel)

    def stats(self) -> worker_pb2.StatsResponse:
        stub = self.prefill_stub if self.role == "prefill" else self.decode_stub
        return stub.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT_S)

    def stderr(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> int:
        """Close the channel, SIGTERM (then SIGKILL); returns the exit code."""
        if self.channel is not None:
            self.channel.close()
        code = super().stop(timeout_s)
        self._stderr.close()
        return code


def spawner(log_dir: Path) -> Iterator[Callable[..., Worker]]:
    """Yields ``spawn(role, model_dir, *flags, name=None, wait=True)`` -> a Worker; at the end
    stops every worker it started and prints each one's stderr (pytest shows it only for a
    failed test). The generator behind the ``spawn`` fixtures (tests/conftest.py)."""
    started: list[Worker] = []

    def spawn(role: str, model: Path, *flags: str, name: str | None = None, wait: bool = True) -> Worker:
        worker = Worker(role, model, list(flags), log_dir, name or f"{role}-{len(started)}", wait=wait)
        started.append(worker)
        return worker

    yield spawn
    for worker in started:
        worker.stop()
    for worker in started:
        print(f"----- {worker.stderr_path.name} (rc={worker.proc.returncode}) -----")
        print(worker.stderr_path.read_text(errors="replace")[-6000:])


# -- requests -------------------------------------------------------------------------------

def greedy(max_tokens: int, **kwargs: Any) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[worker_pb2.TokenLogprobs] = field(default_factory=list)
    responses: list[worker_pb2.GenerateResponse] = field(default_factory=list)
    error: grpc.RpcError | None = None
    submit_error: grpc.RpcError | None = None

    @property
    def final(self) -> worker_pb2.GenerateResponse:
        return self.responses[-1]


class DecodeCall:
    """One request on a ``DecodeWorker.Session`` stream of its own, read as the request's own
    stream: iterate it (or ``next``) for its ``GenerateResponse`` messages; a refusal or failure on
    the stream (an output's ``error_code``) is raised as the ``grpc.RpcError`` with that status,
    after the tokens that came with it; ``cancel()`` breaks the stream, and the worker stops what
    was open on it (as when the router goes away), so reading on raises CANCELLED."""

    def __init__(self, decode: Worker, request: worker_pb2.GenerateRequest, timeout_s: float) -> None:
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox.put(worker_pb2.DecodeSessionRequest(generate=[request]))
        self._call = decode.decode_stub.Session(iter(self._outbox.get, None), timeout=timeout_s)
        self._outputs = self._read()

    def __iter__(self) -> DecodeCall:
        return self

    def __next__(self) -> worker_pb2.GenerateResponse:
        return next(self._outputs)

    def _read(self):
        try:
            for message in self._call:
                for output in message.outputs:
                    if output.error_code:
                        if output.token_ids:
                            tokens = worker_pb2.GenerateResponse()
                            tokens.CopyFrom(output)
                            for name in ("error_code", "error", "error_transient"):
                                tokens.ClearField(name)
                            yield tokens
                        raise refusal(output.error_code, output.error, output.error_transient)
                    yield output
                    if output.finish_reason:
                        return
        finally:
            self._outbox.put(None)   # half-close: with nothing open on it, the worker ends the stream

    def cancel(self) -> None:
        self._call.cancel()


def open_generate(decode: Worker, prefill_address: str, request_id: str, prompt: list[int],
                  sampling: worker_pb2.SamplingParams, timeout_s: float = RPC_TIMEOUT_S,
                  local_prefill: bool = False) -> DecodeCall:
    """Start a request on D (KV from the prefill worker at ``prefill_address``, or ``local_prefill``)."""
    request = worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                         prefill_address=prefill_address, local_prefill=local_prefill)
    return DecodeCall(decode, request, timeout_s)


def submit(prefill: Worker, decode_address: str, request_id: str, prompt: list[int],
           sampling: worker_pb2.SamplingParams) -> worker_pb2.SubmitResponse:
    """Submit a prompt to P on a ``PrefillWorker.Session`` stream of its own: its answer, or the
    refusal raised as the ``grpc.RpcError`` with its status. The request outlives the stream."""
    request = worker_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                       decode_address=decode_address)
    messages = prefill.prefill_stub.Session(iter([worker_pb2.PrefillSessionRequest(submit=[request])]),
                                            timeout=RPC_TIMEOUT_S)
    [answer] = [answer for message in messages for answer in message.results]
    if answer.error_code:
        raise refusal(answer.error_code, answer.error)
    return answer


def collect(call: DecodeCall) -> Result:
    result = Result()
    try:
        for response in call:
            result.responses.append(response)
            result.token_ids += response.token_ids
            result.logprobs += response.logprobs
    except grpc.RpcError as exc:
        result.error = exc
    return result


def generate(prefill: Worker, decode: Worker, request_id: str, prompt: list[int],
             sampling: worker_pb2.SamplingParams, timeout_s: float = RPC_TIMEOUT_S) -> Result:
    """One request through the pair, as the router sends it: started on D, submitted to P, D's
    stream read to its end.

    A Submit refused ABORTED came after the pair's handshake had already failed the request (the
    decode stream ends with that reason, so it is read); any other refusal cancels the stream."""
    call = open_generate(decode, prefill.grpc, request_id, prompt, sampling, timeout_s)
    submit_error = None
    try:
        submit(prefill, decode.grpc, request_id, prompt, sampling)
    except grpc.RpcError as exc:
        submit_error = exc
        if exc.code() != grpc.StatusCode.ABORTED:
            call.cancel()
    result = collect(call)
    result.submit_error = submit_error
    return result


def run_concurrently(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run every fn on its own thread; results in order; re-raises the first exception."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RPC_TIMEOUT_S * 2)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a request thread hung"
    return results


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str | Callable[[], str],
               interval_s: float = 0.05) -> Any:
    """Poll ``predicate`` until truthy; ``what`` (or its result, built on timeout) names it."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what() if callable(what) else what}")
        time.sleep(interval_s)


def wait_idle(*workers: Worker, timeout_s: float = 15.0) -> None:
    """Poll Stats until every worker's kv_blocks_used is back to 0 (nothing referenced)."""
    for worker in workers:
        wait_until(lambda w=worker: w.stats().kv_blocks_used == 0, timeout_s,
                   lambda w=worker: f"{w.role} kv_blocks_used == 0; Stats now: {w.stats()}")


def start_pair(spawn: Callable[..., Worker], model: Path | str, *flags: str, decode_model: Path | str | None = None,
               prefill_flags: tuple[str, ...] = (), decode_flags: tuple[str, ...] = (),
               names: tuple[str | None, str | None] = (None, None)) -> tuple[Worker, Worker]:
    """A prefill and a decode worker from ``spawn`` (the fixture), both started before either is
    waited on, so their models load side by side; returns them once both are ready."""
    prefill = spawn("prefill", model, *flags, *prefill_flags, name=names[0], wait=False)
    decode = spawn("decode", decode_model or model, *flags, *decode_flags, name=names[1], wait=False)
    prefill.wait_ready()
    decode.wait_ready()
    return prefill, decode


def pool_flags(num_blocks: int = POOL_BLOCKS, block_size: int = BLOCK_SIZE) -> list[str]:
    return ["--num-gpu-blocks-override", str(num_blocks), "--block-size", str(block_size)]


def prompts_for(lengths: list[int], seed: int) -> list[list[int]]:
    return [random_prompt(seed=seed + i, num_tokens=n) for i, n in enumerate(lengths)]


def check_greedy_matches_colocated(prefill, decode, reference, lengths: list[int], max_tokens: list[int],
                                   seed: int, tag: str) -> list:
    """Concurrent greedy requests through the P/D pair: every one gives the colocated LLM's tokens
    and ends with finish_reason "length"; returns the results (both workers idle again)."""
    prompts = prompts_for(lengths, seed=seed)
    expected = reference(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens])
    results = run_concurrently([
        (lambda i=i: generate(prefill, decode, f"{tag}-{i}", prompts[i], greedy(max_tokens[i])))
        for i in range(len(prompts))])
    assert len(results) == len(expected) == len(prompts)
    for i, (result, ref) in enumerate(zip(results, expected)):
        assert result.error is None and result.submit_error is None, (i, result.error, result.submit_error)
        assert result.token_ids == ref.token_ids, f"request {i} (prompt {lengths[i]} tokens)"
        assert result.final.finish_reason == "length"
    wait_idle(prefill, decode)
    return results


def check_logprobs_match(result, ref, num_top: int) -> None:
    """A worker pair's TokenLogprobs equal the colocated LLM's entries: one per token, the
    sampled token's logprob, and the top ``num_top`` token ids (in order) with their logprobs."""
    assert len(result.logprobs) == len(ref.logprobs) == len(ref.token_ids)
    for token, entry, got in zip(ref.token_ids, ref.logprobs, result.logprobs):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
        assert got.token_id == token
        assert got.logprob == pytest.approx(entry[token], abs=LOGPROB_ABS_TOL)
        assert list(got.top_token_ids) == [t for t, _ in top]
        assert list(got.top_logprobs) == pytest.approx([lp for _, lp in top], abs=LOGPROB_ABS_TOL)
