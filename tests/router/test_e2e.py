"""End to end with real worker processes on the tiny random-weight model (tests/models.py):
the openai client and the SDK agree, disconnects free every block, and kill -9 of a prefill or a
decode worker mid-stream leaves every request complete with the undisturbed greedy text."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from router.policies.round_robin import RoundRobin
from tandem_client import TandemClient
from tests.metrics import metric, scrape
from tests.router.clusters import RealWorker, real_cluster

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NAME = "tiny"
LOG_INTERVAL_S = 0.1    # a decode worker adds to tandem_generation_tokens_total this often


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory, loop_thread):
    yield from real_cluster(loop_thread, tiny_model_dir("llama"), ("prefill", "prefill", "decode", "decode"),
                            tmp_path_factory.mktemp("router-e2e"), NAME, "--num-gpu-blocks-override", "256",
                            "--log-interval-s", str(LOG_INTERVAL_S))


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="x", max_retries=0, timeout=120)


def _greedy_texts(client, prompts: list[str], max_tokens: int) -> list[str]:
    return [client.completions.create(model=NAME, prompt=p, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for p in prompts]


def _wait_no_blocks(router, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    with TandemClient(router.grpc_address) as sdk:
        while True:
            used = [(w.role, w.kv_blocks_used) for w in sdk.cluster() if w.healthy]   # no addresses: a tenant's view
            if not any(n for _, n in used):
                return
            assert time.monotonic() < deadline, f"blocks still used: {used}"
            time.sleep(0.2)


def test_openai_client_sdk_and_streaming_agree(cluster):
    router, _ = cluster
    client = _client(router)
    full = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="The quick brown fox", max_tokens=20, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == full.choices[0].text and full.usage.completion_tokens == 20
    with TandemClient(router.grpc_address) as sdk:
        out = sdk.generate("The quick brown fox", max_tokens=20, temperature=0.0, ignore_eos=True)
        assert out.text == full.choices[0].text and len(out.token_ids) == 20
        chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                              temperature=0, extra_body={"ignore_eos": True})
        sdk_chat = sdk.chat([{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0.0, ignore_eos=True)
        assert sdk_chat.text == chat.choices[0].message.content
        assert [m.id for m in sdk.models()] == [NAME] == [m.id for m in client.models.list().data]
    assert httpx.get(f"http://{router.http_address}/v1/cluster").json()["workers"][0]["model"]


def test_cluster_view_counts_the_workers_prefix_cache_hits(cluster):
    """/v1/cluster carries each worker's prefix-cache tokens looked up and found (benchmarks read
    it to tell a cached prompt from a computed one)."""
    router, _ = cluster
    client = _client(router)
    url = f"http://{router.http_address}/v1/cluster"

    def hits() -> tuple[int, int]:
        workers = httpx.get(url).json()["workers"]
        return sum(w["prefix_cache_hits"] for w in workers), sum(w["prefix_cache_queries"] for w in workers)

    before = hits()
    prompt = " ".join(f"word{i}" for i in range(60))   # several full KV blocks
    for _ in range(2):
        client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    deadline = time.monotonic() + 10
    while hits()[0] - before[0] < 48:   # the workers' stats snapshots lag a step: wait for all of them
        assert time.monotonic() < deadline, f"no prefix-cache hit counted: {hits()} (before: {before})"
        time.sleep(0.2)
    found, asked = hits()
    assert found - before[0] >= 48 and asked - before[1] >= found - before[0]


def test_tandem_bench_against_the_real_stack(cluster, tmp_path):
    """`tandem bench` drives the router (over HTTP and gRPC) in front of real workers."""
    router, _ = cluster
    for backend, target in (("openai-chat", ["--base-url", f"http://{router.http_address}"]),
                            ("grpc", ["--grpc-target", router.grpc_address])):
        out = tmp_path / backend
        proc = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "--backend", backend, *target,
                               "--model", NAME, "--tokenizer", str(router.config.model), "--dataset", "random",
                               "--input-len", "24", "--output-len", "6", "--num-prompts", "8", "--request-rate",
                               "inf", "--max-concurrency", "4", "--ignore-eos", "--out", str(out), "--no-progress"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        summary = json.loads((out / "results.json").read_text())["summary"]
        assert summary["completed"] == 8 and summary["failed"] == 0, summary
        assert summary["total_output_tokens"] == 48, summary
        assert all((out / name).stat().st_size > 1000 for name in
                   ("latency_cdf.png", "tokens_per_s.png", "ttft_vs_prompt_len.png"))


def _blocks_used(router, loop_thread, workers: list[RealWorker]) -> dict[str, int]:
    """kv_blocks_used asked of each worker now, through the router's own stubs (its cluster view
    is only as fresh as the last heartbeat)."""
    async def poll() -> dict[str, int]:
        states = [router.registry.get(w.address) for w in workers]
        await asyncio.gather(*(router.registry.poll(state) for state in states))
        return {state.address: state.stats.kv_blocks_used for state in states}
    return loop_thread.run(poll())


def _generated_tokens(decoders: list[RealWorker]) -> float:
    """Tokens the decode workers generated so far, once their counters stopped moving."""
    def read() -> float:
        return sum(metric(scrape(w.metrics), "tandem_generation_tokens_total") for w in decoders)
    last = read()
    while True:
        time.sleep(3 * LOG_INTERVAL_S)
        now = read()
        if now == last:
            return now
        last = now


def test_disconnect_mid_stream_leaves_no_blocks_used(cluster, loop_thread):
    """Each disconnect must stop generation: without the abort the request would run to
    max_tokens. Blocks are seen in use before the disconnect and free after it."""
    router, workers = cluster
    client = _client(router)
    every = workers["prefill"] + workers["decode"]
    max_tokens = 240     # with the short prompt, nearly all the tiny model's 256 positions
    for _ in range(3):
        before = _generated_tokens(workers["decode"])
        stream = client.completions.create(model=NAME, prompt="Tell me a story", max_tokens=max_tokens, stream=True,
                                           temperature=0, extra_body={"ignore_eos": True})
        next(iter(stream))
        assert any(_blocks_used(router, loop_thread, workers["decode"]).values())
        stream.close()
        deadline = time.monotonic() + 20
        while any(used := _blocks_used(router, loop_thread, every).values()):
            assert time.monotonic() < deadline, f"blocks still used: {used}"
            time.sleep(0.05)
        generated = _generated_tokens(workers["decode"]) - before
        assert 1 <= generated < max_tokens, "generation must stop at the disconnect, not run to max_tokens"
    _wait_no_blocks(router)


def _failover_run(router, kill, prompts: list[str], max_tokens: int, expected: list[str] | None = None) -> None:
    client = _client(router)
    if expected is None:
        expected = _greedy_texts(client, prompts, max_tokens)
    results: list[str | None] = [None] * len(prompts)
    counts = [0] * len(prompts)
    started = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        stream = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        parts, first = [], True
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
            if chunk.usage:
                counts[i] = chunk.usage.completion_tokens
            if first:
                first = False
                started.wait(60)
        results[i] = "".join(parts)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    kill(started)
    for t in threads:
        t.join(120)
    assert counts == [max_tokens] * len(prompts)
    assert results == expected


def test_kill_9_decode_worker_mid_stream(cluster):
    router, workers = cluster
    prompts = [f"Story number {i} begins" for i in range(6)]

    def kill(started):
        started.wait(60)                 # every stream has its first chunk
        workers["decode"][0].kill()
    before = router.metrics.failovers._value.get()
    _failover_run(router, kill, prompts, max_tokens=120)
    assert router.metrics.failovers._value.get() > before
    _wait_no_blocks(router)


def test_kill_9_prefill_worker_mid_stream(cluster, caplog):
    """Requests whose prefill worker dies move to the other prefill worker and keep their
    decode reservation (docs/architecture.md#failure-handling); every stream completes with the undisturbed text."""
    router, workers = cluster
    prompts = [" ".join(["word"] * 150) + f" {i}" for i in range(6)]
    expected = _greedy_texts(_client(router), prompts, 40)   # undisturbed
    victim = workers["prefill"][0]
    # Round robin, so the victim surely gets requests (cache_aware would keep these shared-prefix
    # prompts on whichever worker saw them first).
    router.dispatcher.prefill_policy = RoundRobin()
    victim.proc.send_signal(signal.SIGSTOP)   # still "healthy" for a heartbeat or two: gets requests

    def kill(started):
        time.sleep(0.5)                       # requests now wait on the stopped worker
        victim.kill()
        started.wait(60)
    before = router.metrics.failovers._value.get()
    with caplog.at_level("WARNING", logger="router.dispatch"):
        _failover_run(router, kill, prompts, max_tokens=40, expected=expected)
    assert router.metrics.failovers._value.get() > before
    assert "keeping its decode reservation" in caplog.text
    _wait_no_blocks(router)
