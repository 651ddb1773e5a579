"""What operators and grpcurl see: health, reflection, /metrics, log lines, clean shutdown.

One prefill + decode pair with a 0.5 s log interval; the last test shuts both down with
SIGTERM and checks the exit code and that each /dev/shm pool is gone.
"""
from __future__ import annotations

import signal
import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.metrics import samples, scrape
from tests.workers.harness import (
    generate,
    greedy,
    pool_flags,
    prompts_for,
    run_concurrently,
    start_pair,
    wait_idle,
    wait_until,
)

SERVICE = {"prefill": "tandem.v1.PrefillWorker", "decode": "tandem.v1.DecodeWorker"}
LENGTHS = [9, 30, 17]
MAX_TOKENS = [5, 12, 8]


@pytest.fixture(scope="module")
def pair(spawn_module, tiny_dir):
    flags = [*pool_flags(), "--log-interval-s", "0.5"]
    return start_pair(spawn_module, tiny_dir, *flags)


def metrics(worker) -> dict[str, float]:
    """Every sample of the worker's /metrics page: ``name{labels}`` -> value."""
    return samples(scrape(worker.metrics))


def sample(worker, name: str) -> float:
    return metrics(worker)[f'{name}{{role="{worker.role}"}}']


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_health_and_reflection(pair, role):
    worker = pair[0] if role == "prefill" else pair[1]
    health = health_pb2_grpc.HealthStub(worker.channel)
    for service in ("", SERVICE[role]):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(worker.channel)
    [response] = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=10)
    names = {s.name for s in response.list_services_response.service}
    assert names == {SERVICE[role], "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    # grpcurl describes methods from the file that defines the service.
    [response] = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE[role])]), timeout=10)
    assert response.file_descriptor_response.file_descriptor_proto


def test_metrics_and_log_lines_after_traffic(pair):
    prefill, decode = pair
    for worker in pair:
        assert "num_blocks_global: 256" in worker.stderr()
        page = metrics(worker)
        for name in ("tandem_num_requests_running", "tandem_kv_cache_usage_ratio", "tandem_kv_cache_blocks_total"):
            assert f'{name}{{role="{worker.role}"}}' in page
        assert sample(worker, "tandem_kv_cache_blocks_total") == 256
    prompt_before = sample(prefill, "tandem_prompt_tokens_total")
    generated_before = sample(decode, "tandem_generation_tokens_total")
    prompts = prompts_for(LENGTHS, seed=9900)
    results = run_concurrently([
        (lambda i=i: generate(prefill, decode, f"obs-{i}", prompts[i], greedy(MAX_TOKENS[i])))
        for i in range(len(prompts))])
    assert [len(r.token_ids) for r in results] == MAX_TOKENS
    wait_idle(prefill, decode)
    # Counters move on the engine thread (prompt tokens each step, generated tokens each log
    # interval): wait out one interval.
    wait_until(lambda: sample(prefill, "tandem_prompt_tokens_total") - prompt_before == sum(LENGTHS), 5,
               "prefill's tandem_prompt_tokens_total to count every prompt token")
    # The decode worker generates every token but the first, which the prefill worker sampled.
    wait_until(lambda: sample(decode, "tandem_generation_tokens_total") - generated_before
               >= sum(MAX_TOKENS) - len(MAX_TOKENS), 5, "decode's tandem_generation_tokens_total to count its tokens")
    assert sample(decode, "tandem_generation_tokens_total") - generated_before <= sum(MAX_TOKENS)
    assert sample(decode, "tandem_kv_cache_usage_ratio") == 0.0
    assert metrics(decode)['tandem_time_to_first_token_seconds_count{role="decode"}'] >= len(LENGTHS)
    # Every engine step is timed by what it computed: the prefill worker ran prompt chunks only,
    # the decode worker decodes (every prompt's second token on) and nothing else.
    prefill_page, decode_page = metrics(prefill), metrics(decode)
    assert prefill_page['tandem_engine_step_seconds_count{kind="prefill",role="prefill"}'] >= 1
    assert prefill_page['tandem_engine_step_seconds_sum{kind="prefill",role="prefill"}'] > 0
    steps = decode_page['tandem_engine_step_seconds_count{kind="decode",role="decode"}']
    assert max(MAX_TOKENS) - 1 <= steps <= sum(MAX_TOKENS)
    assert not any(k.startswith("tandem_engine_step_seconds_count") and 'kind="decode"' not in k for k in decode_page)
    wait_until(lambda: "Prefill batch. #new-seq:" in prefill.stderr(), 5, "a Prefill batch. line")
    wait_until(lambda: "Decode batch. #running-req:" in decode.stderr(), 5, "a Decode batch. line")


def test_sigterm_exits_zero_and_removes_the_shm_pool(pair):
    for worker in pair:
        [pool] = worker.shm_files()
        assert str(pool).startswith(f"/dev/shm/tandem-kv-{worker.pid}-") and pool.exists()
        started = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(10) == 0
        assert time.monotonic() - started < 10
        assert not pool.exists()
        assert f"{worker.role} worker shutting down" in worker.stderr()
