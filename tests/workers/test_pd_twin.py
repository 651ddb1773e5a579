"""The in-process twin of a prefill/decode pd_twin: the real role loops (engine threads), the
engine's disaggregation hooks (after_layer, keep_finished_blocks, add_prefilled) and the fake
kvtransfer backend, with no processes and no gRPC. Outputs must equal the colocated engine's.
"""
from __future__ import annotations

import queue
import time

import pytest
import torch

from decode_worker.worker import DecodeJob, DecodeLoop
from engine.config import SamplingParams
from prefill_worker.worker import PrefillJob, PrefillLoop


def _run(prefill: PrefillLoop, decode: DecodeLoop, prompts, params) -> list[list[int]]:
    streams = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        events: queue.SimpleQueue = queue.SimpleQueue()
        rid = f"twin-{i}"
        decode.call(lambda j=DecodeJob(rid, prompt, p, "in-process", events.put): decode.add(j))
        prefill.call(lambda j=PrefillJob(rid, prompt, p, "in-process"): prefill.submit(j))
        streams.append(events)
    return [_tokens(events) for events in streams]


def _tokens(events: queue.SimpleQueue) -> list[int]:
    """A stream's tokens until its finish event; an error event fails the test."""
    tokens = []
    while True:
        event = events.get(timeout=60)
        assert event.error is None, event.error
        tokens += event.token_ids
        if event.finish_reason is not None:
            return tokens


def _colocated(make_llm, tiny_model_dir, prompts, params, device: str = "cpu", model: str = "llama"):
    llm = make_llm(tiny_model_dir(model), block_size=4, max_model_len=128, device=device)
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_pd_twin_matches_colocated_greedy_and_seeded(pd_twin, make_llm, tiny_model_dir):
    prompts = [[(7 * i + 3 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([3, 17, 40, 9, 64, 1])]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4 + \
             [SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)] * 2
    prefill, decode = pd_twin(chunked_prefill_size=16)  # the 40- and 64-token prompts take several chunks
    assert _run(prefill, decode, prompts, params) == _colocated(make_llm, tiny_model_dir, prompts, params)
    # Everything returns: the prefill worker's blocks sit in its prefix cache, the decode pool is empty.
    assert prefill.engine.allocator.num_used_blocks == 0
    assert decode.engine.allocator.num_used_blocks == 0 and not decode.jobs and not prefill.jobs


@pytest.mark.parametrize("model", ["qwen3_moe", "mixtral"])
def test_pd_twin_of_a_mixture_of_experts_model_matches_colocated(pd_twin, make_llm, tiny_model_dir, model):
    # Attention, its KV layout and the transfer are the dense model's; the experts run on each side.
    prompts = [[(5 * i + 11 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([3, 17, 40, 9])]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3 + \
             [SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)]
    prefill, decode = pd_twin(chunked_prefill_size=16, model=model)
    assert _run(prefill, decode, prompts, params) == _colocated(make_llm, tiny_model_dir, prompts, params,
                                                                model=model)
    assert prefill.engine.allocator.num_used_blocks == 0
    assert decode.engine.allocator.num_used_blocks == 0 and not decode.jobs and not prefill.jobs


def test_pd_twin_ships_each_chunk_layer_by_layer_when_the_destination_came_first(pd_twin, make_llm, tiny_model_dir):
    """A prompt whose destination is known before it is computed: every chunk's forward writes
    the blocks it filled (a partly filled block again with the next chunk), so the KV moves
    beside every chunk, not only the last; the decode worker still gets exactly the prompt's KV."""
    prompts = [[(11 * i + 5 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([40, 64, 23])]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * len(prompts)
    prefill, decode = pd_twin(chunked_prefill_size=16)
    writes: list[tuple[str, int, tuple[int, ...]]] = []
    write = prefill.rank.write

    def spy(request_id, layers, src, dst):
        writes.extend((request_id, layer, tuple(dst)) for layer in layers)
        return write(request_id, layers, src, dst)

    prefill.rank.write = spy
    streams = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        events: queue.SimpleQueue = queue.SimpleQueue()
        decode.call(lambda j=DecodeJob(f"early-{i}", prompt, p, "in-process", events.put): decode.add(j))
        streams.append(events)
    deadline = time.monotonic() + 30
    while len(prefill.early) < len(prompts):       # every destination is there before its Submit
        assert time.monotonic() < deadline, prefill.early
        time.sleep(0.01)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        prefill.call(lambda j=PrefillJob(f"early-{i}", prompt, p, "in-process"): prefill.submit(j))
    assert [_tokens(events) for events in streams] == _colocated(make_llm, tiny_model_dir, prompts, params)
    for i, prompt in enumerate(prompts):
        layer0 = [dst for rid, layer, dst in writes if rid == f"early-{i}" and layer == 0]
        # One write per chunk (the step's 16-token budget is shared, so a prompt takes >= its
        # length / 16 chunks), each from where the last one's whole blocks ended ...
        assert len(layer0) >= -(-len(prompt) // 16), layer0
        order = list(dict.fromkeys(b for dst in layer0 for b in dst))    # blocks in prompt order
        for before, after in zip(layer0, layer0[1:]):
            assert order.index(after[0]) in (order.index(before[-1]), order.index(before[-1]) + 1), layer0
        # ... and together every block of the prompt (block_size 4).
        assert len(order) == -(-len(prompt) // 4), layer0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pd_twin_on_cuda_matches_colocated_on_cuda(pd_twin, make_llm, tiny_model_dir):
    """Both engines on the GPU (Triton attention, CUDA pools): the prefill side's per-layer
    capture and the block copies into the decode pool run on the device."""
    prompts = [[(7 * i + 3 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([3, 17, 40, 9, 64, 1])]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4 + \
             [SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)] * 2
    prefill, decode = pd_twin(chunked_prefill_size=16, device="cuda")
    assert decode.engine.runner.kv_pool.tensor.device.type == "cuda"
    assert _run(prefill, decode, prompts, params) == _colocated(make_llm, tiny_model_dir, prompts, params,
                                                                device="cuda")
    assert prefill.engine.allocator.num_used_blocks == 0
    assert decode.engine.allocator.num_used_blocks == 0 and not decode.jobs and not prefill.jobs


def test_pd_twin_retracts_under_a_small_decode_pool(pd_twin, make_llm, tiny_model_dir):
    prompts = [[(11 * i + j) % 40000 + 100 for j in range(10 + 3 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 6
    prefill, decode = pd_twin(decode_blocks=40, max_model_len=64)
    assert _run(prefill, decode, prompts, params) == _colocated(make_llm, tiny_model_dir, prompts, params)
    assert decode.engine.scheduler.num_retracted_total > 0
    assert decode.engine.allocator.num_used_blocks == 0


def test_pd_twin_moves_a_request_to_another_prefill_worker(pd_twin, make_llm, tiny_model_dir):
    """The first prefill worker never answers; SetPrefill points the decode reservation at
    the live one, which computes and ships the prompt."""
    prefill, decode = pd_twin()
    prompt, params = [100 + j for j in range(23)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    events: queue.SimpleQueue = queue.SimpleQueue()
    decode.call(lambda: decode.add(DecodeJob("moved", prompt, params, "dead-prefill:1", events.put)))
    deadline = time.monotonic() + 30
    while "moved" not in decode.transferring:      # reserved, destination sent to the dead worker
        assert time.monotonic() < deadline
        time.sleep(0.01)
    moved = []
    decode.call(lambda: moved.append(decode.set_prefill("moved", "in-process")))
    prefill.call(lambda: prefill.submit(PrefillJob("moved", prompt, params, "in-process")))
    tokens = _tokens(events)
    assert moved == [True]
    assert tokens == _colocated(make_llm, tiny_model_dir, [prompt], [params])[0]
    unknown = []
    decode.call(lambda: unknown.append(decode.set_prefill("no-such-request", "in-process")))
    deadline = time.monotonic() + 10
    while not unknown:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert unknown == [False]


def test_pd_twin_a_destination_that_comes_after_its_abort_is_cancelled_at_once(pd_twin):
    """The decode worker's SetDestination and its Abort are separate RPCs to the prefill worker,
    and the Abort can come first: the late destination is cancelled at the decode worker at
    once, which frees its blocks now rather than when the 30 s lease runs out."""
    prefill, decode = pd_twin()
    aborted: list[bool] = []
    prefill.call(lambda: aborted.append(prefill.abort("late")))
    events: queue.SimpleQueue = queue.SimpleQueue()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    decode.call(lambda: decode.add(DecodeJob("late", [100 + j for j in range(9)], params, "in-process", events.put)))
    event = events.get(timeout=10)
    assert aborted == [False]
    assert "cancelled by sender: aborted at the prefill worker" in event.error, event
    deadline = time.monotonic() + 10
    while decode.engine.stats().kv_blocks_used or decode.releasing:
        assert time.monotonic() < deadline, "the decode worker's blocks were not freed"
        time.sleep(0.01)
    assert "late" not in prefill.early and not decode.jobs


@pytest.mark.parametrize("num_resumed", [1, 5])
def test_a_resumed_request_continues_as_its_first_attempt(pd_twin, make_llm, tiny_model_dir, num_resumed):
    """Failover re-sends prompt + the output streamed so far with ``num_resumed_tokens``: a seeded
    request's draws and its frequency/presence penalties go on from there, so the resumed stream
    (colocated, and through a prefill/decode pd_twin) is the first attempt's tail. Without the field,
    the seed restarts and the penalties forget the earlier output."""
    prompt = [(11 * j) % 40000 + 100 for j in range(21)]
    first = SamplingParams(temperature=0.9, seed=5, max_tokens=14, ignore_eos=True,
                           frequency_penalty=0.7, presence_penalty=0.4)
    [ref] = _colocated(make_llm, tiny_model_dir, [prompt], [first])
    resumed_prompt = prompt + ref[:num_resumed]
    resumed = SamplingParams(temperature=0.9, seed=5, max_tokens=14 - num_resumed, ignore_eos=True,
                             frequency_penalty=0.7, presence_penalty=0.4, num_resumed_tokens=num_resumed)
    [colocated] = _colocated(make_llm, tiny_model_dir, [resumed_prompt], [resumed])
    assert ref[:num_resumed] + colocated == ref
    prefill, decode = pd_twin(chunked_prefill_size=16)
    assert ref[:num_resumed] + _run(prefill, decode, [resumed_prompt], [resumed])[0] == ref


def test_pd_twin_a_decode_request_has_one_stage_and_the_indexes_follow_it(pd_twin):
    """DecodeJob.state is the request's stage on the decode worker, and the loop's per-stage
    indexes agree with it: reserved and waiting for KV (TRANSFERRING), aborted in flight
    (RELEASING: its stream ended, its id not reusable until its blocks are freed); a shipped
    request RUNNING once its first token is out, gone once aborted."""
    from decode_worker.worker import DecodeState

    # A 4 s lease (30 s by default): the aborted transfer's blocks come back that long after it
    # was reserved, which the end of the test waits for.
    prefill, decode = pd_twin(kv_lease_s=4.0)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompt = [100 + j for j in range(9)]
    seen: queue.SimpleQueue = queue.SimpleQueue()

    def stage(rid: str) -> None:   # on the engine thread, between steps
        job = decode.jobs.get(rid)
        seen.put((job.state if job else None, rid in decode.prealloc, rid in decode.transferring,
                  rid in decode.releasing))

    def on_engine_thread(fn) -> object:
        decode.call(lambda: seen.put(fn()))
        return seen.get(timeout=10)

    events: queue.SimpleQueue = queue.SimpleQueue()
    decode.call(lambda: decode.add(DecodeJob("stages", prompt, params, "dead-prefill:1", events.put)))
    deadline = time.monotonic() + 30
    while "stages" not in decode.transferring:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    decode.call(lambda: stage("stages"))
    assert seen.get(timeout=10) == (DecodeState.TRANSFERRING, False, True, False)
    decode.call(lambda: (decode.abort("stages"), stage("stages")))
    assert seen.get(timeout=10) == (DecodeState.RELEASING, False, False, True)
    assert events.get(timeout=10).finish_reason == "abort"
    assert on_engine_thread(lambda: decode.abort("stages")) is False      # its stream already ended

    def add(job: DecodeJob) -> str:
        try:
            decode.add(job)
        except KeyError as exc:
            return str(exc)
        return "added"
    # Its blocks wait for the transfer's lease (no writer ever came); until then the id is taken.
    assert "is still being cleaned up here" in on_engine_thread(
        lambda: add(DecodeJob("stages", prompt, params, "in-process", events.put)))

    decode.call(lambda: decode.add(DecodeJob("stages-2", prompt, params, "in-process", events.put)))
    prefill.call(lambda: prefill.submit(PrefillJob("stages-2", prompt, params, "in-process")))
    assert events.get(timeout=30).token_ids
    decode.call(lambda: stage("stages-2"))
    assert seen.get(timeout=10) == (DecodeState.RUNNING, False, False, False)
    assert on_engine_thread(lambda: decode.abort("stages-2")) is True
    decode.call(lambda: stage("stages-2"))
    assert seen.get(timeout=10) == (None, False, False, False)
    while decode.engine.stats().kv_blocks_used:
        assert time.monotonic() < deadline + 30
        time.sleep(0.01)
