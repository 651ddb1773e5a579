"""Conditional disaggregation at the router: a prompt of at most ``local_prefill_max_tokens``
tokens goes to a decode worker alone (``GenerateRequest.local_prefill``), a longer one to a
prefill/decode pair; the local path needs no prefill worker and fails over like any other."""
from __future__ import annotations

import pytest

from tandem_client import AsyncTandemClient, Unavailable
from tests.router.clusters import run, until
from tests.router.fake_workers import fake_completion

SHORT = [11, 12, 13]
LONG = list(range(20, 40))


def _idle(cluster) -> bool:
    return all(cluster.router.registry.get(w.address).num_inflight == 0 for w in cluster.workers)


async def _tokens(cluster, prompt: list[int], max_tokens: int = 6) -> list[int]:
    async with AsyncTandemClient(cluster.router.grpc_address) as client:
        chunks = [c async for c in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0)]
    return [t for c in chunks for t in c.token_ids]


def test_short_prompts_go_to_the_decode_worker_alone_and_long_ones_to_a_pair(loop_thread, tokenizer):
    async def body(cluster):
        [prefill], [decode] = cluster.prefills, cluster.decodes
        assert await _tokens(cluster, SHORT) == fake_completion(SHORT, 6)
        assert len(decode.state.local_prefill) == 1 and prefill.state.seen == []
        assert await _tokens(cluster, LONG) == fake_completion(LONG, 6)
        assert len(prefill.state.seen) == 1 and len(decode.state.local_prefill) == 1
        assert decode.state.seen == [decode.state.local_prefill[0], prefill.state.seen[0]]
        await until(lambda: _idle(cluster))
    run(loop_thread, tokenizer, body, local_prefill_max_tokens=len(SHORT))


def test_off_by_default_every_prompt_goes_to_a_prefill_worker(loop_thread, tokenizer):
    async def body(cluster):
        [prefill], [decode] = cluster.prefills, cluster.decodes
        assert await _tokens(cluster, SHORT) == fake_completion(SHORT, 6)
        assert decode.state.local_prefill == [] and len(prefill.state.seen) == 1
    run(loop_thread, tokenizer, body)


def test_without_any_prefill_worker_short_prompts_are_served_and_long_ones_refused(loop_thread, tokenizer):
    async def body(cluster):
        [decode] = cluster.decodes
        assert await _tokens(cluster, SHORT) == fake_completion(SHORT, 6)
        assert len(decode.state.local_prefill) == 1
        with pytest.raises(Unavailable, match="no prefill worker"):
            await _tokens(cluster, LONG)
    run(loop_thread, tokenizer, body, num_prefill=0, local_prefill_max_tokens=len(SHORT), failover_wait_s=0.0)


def test_a_local_prefill_fails_over_to_another_decode_worker_without_gaps(loop_thread, tokenizer):
    async def body(cluster):
        bad, good = cluster.decodes
        bad.servicer.fail_after_tokens = 3
        cluster.router.registry.get(good.address).num_inflight = 1   # make least_load pick `bad` first
        tokens = await _tokens(cluster, SHORT, max_tokens=10)
        cluster.router.registry.get(good.address).num_inflight -= 1
        assert tokens == fake_completion(SHORT, 10)
        # The retry's prompt is the prompt plus 3 streamed tokens: still short enough to stay local.
        assert len(bad.state.local_prefill) == 1
        assert [rid for rid in good.state.local_prefill if rid.endswith(".retry1")]
        assert cluster.prefills[0].state.seen == []
        await until(lambda: _idle(cluster))
    run(loop_thread, tokenizer, body, num_decode=2, local_prefill_max_tokens=len(SHORT) + 3)
