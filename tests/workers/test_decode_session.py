"""``DecodeWorker.Session`` and ``PrefillWorker.Session``: many requests on one stream, as the
router sends them (router/session.py).

Requests on one session give exactly what the colocated `LLM` gives, local and shipped prompts
side by side, with several requests' tokens in one message; a malformed request is refused on
the stream with its own status and nothing else on it is disturbed; an abort on the stream, and
the stream going away with requests still open, free every block on both workers.

Real processes on the tiny random-weight Llama (tests/workers/conftest.py)."""
from __future__ import annotations

import queue
import threading

import grpc

from engine.config import SamplingParams
from protos.tandem.v1 import worker_pb2
from tests.workers.harness import greedy, prompts_for, submit, wait_idle, wait_until


class Session:
    """A client's end of one Session stream: ``send`` messages, read ``responses`` on a thread."""

    def __init__(self, decode) -> None:
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.call = decode.decode_stub.Session(iter(self._outbox.get, None), timeout=120)
        self.outputs: dict[str, list[worker_pb2.GenerateResponse]] = {}
        self.num_messages = 0
        self.widest = 0                     # most requests one message carried
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def send(self, generate=(), abort=()) -> None:
        self._outbox.put(worker_pb2.DecodeSessionRequest(generate=list(generate), abort=list(abort)))

    def _read(self) -> None:
        try:
            for response in self.call:
                self.num_messages += 1
                self.widest = max(self.widest, len({o.request_id for o in response.outputs}))
                for output in response.outputs:
                    self.outputs.setdefault(output.request_id, []).append(output)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()

    def done(self, request_id: str) -> bool:
        outputs = self.outputs.get(request_id, [])
        return bool(outputs) and bool(outputs[-1].finish_reason or outputs[-1].error_code)

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs.get(request_id, []) for t in o.token_ids]

    def close(self) -> None:
        self._outbox.put(None)          # half-close: the worker ends the stream once nothing is open


def test_requests_on_one_session_match_colocated_and_share_messages(pd_pair, reference):
    prefill, decode = pd_pair
    lengths, max_tokens = [3, 70, 17, 40, 9, 25], [12, 20, 16, 8, 20, 14]
    prompts = prompts_for(lengths, seed=7300)
    expected = reference(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens])
    session = Session(decode)
    requests = []
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        local = i % 2 == 0
        requests.append(worker_pb2.GenerateRequest(
            request_id=f"session-{i}", prompt_token_ids=prompt, sampling=greedy(m), local_prefill=local,
            prefill_address="" if local else prefill.grpc))
    bad = worker_pb2.GenerateRequest(request_id="session-bad", prompt_token_ids=[1, 10**9], sampling=greedy(4),
                                     local_prefill=True)
    session.send(requests[:3] + [bad])
    session.send(requests[3:])
    # The shipped prompts go to the prefill worker on its own Session stream, as the router sends them.
    submits = [worker_pb2.SubmitRequest(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                                        sampling=r.sampling, decode_address=decode.grpc)
               for r in requests if not r.local_prefill]
    bad_submit = worker_pb2.SubmitRequest(request_id="submit-bad", prompt_token_ids=[], sampling=greedy(4),
                                          decode_address=decode.grpc)
    answers = {a.request_id: a for m in prefill.prefill_stub.Session(
        iter([worker_pb2.PrefillSessionRequest(submit=[*submits, bad_submit])]), timeout=60) for a in m.results}
    assert sorted(answers) == sorted([s.request_id for s in submits] + ["submit-bad"])
    assert all(not answers[s.request_id].error_code for s in submits)
    assert answers["submit-bad"].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    wait_until(lambda: all(session.done(r.request_id) for r in requests) and session.done("session-bad"), 60,
               lambda: f"every request on the session to end; outputs: {session.outputs}")
    [refusal] = session.outputs["session-bad"]
    assert refusal.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "vocab" in refusal.error
    for i, (request, ref) in enumerate(zip(requests, expected)):
        final = session.outputs[request.request_id][-1]
        assert not final.error_code, (i, final.error)
        assert session.tokens(request.request_id) == ref.token_ids, i
        assert (final.finish_reason, final.num_prompt_tokens, final.num_output_tokens) == \
            ("length", lengths[i], max_tokens[i])
    assert session.widest >= 2                  # one step's tokens for several requests, one message
    assert session.num_messages < sum(max_tokens)
    session.close()
    assert session.ended.wait(10) and session.error is None   # nothing open: the worker ends the stream
    wait_idle(prefill, decode)


def test_an_abort_on_the_session_and_a_dropped_session_free_every_block(pd_pair):
    prefill, decode = pd_pair
    prompts = prompts_for([60, 50, 30], seed=7400)
    session = Session(decode)
    shipped = worker_pb2.GenerateRequest(request_id="drop-shipped", prompt_token_ids=prompts[0], sampling=greedy(400),
                                         prefill_address=prefill.grpc)
    local = worker_pb2.GenerateRequest(request_id="drop-local", prompt_token_ids=prompts[1], sampling=greedy(400),
                                       local_prefill=True)
    aborted = worker_pb2.GenerateRequest(request_id="drop-aborted", prompt_token_ids=prompts[2],
                                         sampling=greedy(400), local_prefill=True)
    session.send([shipped, local, aborted])
    submit(prefill, decode.grpc, shipped.request_id, list(shipped.prompt_token_ids), shipped.sampling)
    wait_until(lambda: all(session.tokens(r.request_id) for r in (shipped, local, aborted)), 30,
               "first tokens of all three requests")
    session.send(abort=["drop-aborted"])
    wait_until(lambda: decode.stats().num_running == 2, 10, "the aborted request to leave the batch")
    assert not session.done("drop-shipped") and not session.done("drop-local")
    session.call.cancel()                       # the router went away with two requests open
    assert session.ended.wait(10)
    wait_idle(prefill, decode)
    assert decode.stats().num_running == 0
