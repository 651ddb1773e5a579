"""The OpenAI-compatible HTTP API against fake workers: every endpoint via the official openai
client, streaming equals non-streaming, and each bad input's status and error JSON."""
from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from router.admission import MIN_DRAINED
from router.config import RouterConfig
from router.server import Router
from tests.metrics import metric, samples
from tests.router.clusters import MODEL, start_fake_cluster, stop_fake_cluster, until
from tests.router.fake_workers import fake_completion


@pytest.fixture(scope="module")
def client(fake_cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake_cluster.http + "/v1", api_key="unused", max_retries=0)


def test_completions_text_and_tokens_follow_the_worker(client, tokenizer):
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0)
    expected = fake_completion(tokenizer.encode("Hello there"), 6)
    assert out.choices[0].text == tokenizer.decode(expected)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(tokenizer.encode("Hello there")), 6)


def test_streamed_text_equals_non_streamed_text(client):
    for kind in ("completions", "chat"):
        if kind == "completions":
            full = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, temperature=0)
            chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            streamed = "".join(c.choices[0].text for c in chunks if c.choices)
            text = full.choices[0].text
        else:
            messages = [{"role": "user", "content": "Say something"}]
            full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                                  temperature=0)
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            text = full.choices[0].message.content
        assert streamed == text and text
        assert chunks[-1].usage.completion_tokens == 12 == full.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_stop_string_ends_the_request_and_is_not_returned(client, tokenizer, fake_cluster):
    ids = fake_completion(tokenizer.encode("Hello there"), 8)
    text = tokenizer.decode(ids)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=8, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]
    streamed = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=8, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[:text.index(stop)]


def test_n_seed_logprobs_and_vllm_extras(client):
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, n=3, seed=5, logprobs=2,
                                    extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                                                "ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2] and out.usage.completion_tokens == 12
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs[0]) == 2 and lp.token_logprobs[0] == -0.5
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          logprobs=True, top_logprobs=3, n=2, stream=True)
    chunks = [c for c in chat if c.choices]
    assert {c.choices[0].index for c in chunks} == {0, 1}
    # One logprobs entry per token; a chunk carries every token that arrived since the last one.
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 6 and all(len(e.top_logprobs) == 3 for e in entries)


def test_models_cluster_health_metrics(client, fake_cluster):
    assert [m.id for m in client.models.list().data] == [MODEL]
    workers = httpx.get(fake_cluster.http + "/v1/cluster").json()["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    assert all(w["healthy"] and w["kv_blocks_total"] == 1000 for w in workers)
    assert httpx.get(fake_cluster.http + "/health").json() == {"status": "ok"}
    metrics = httpx.get(fake_cluster.http + "/metrics").text
    assert "tandem_time_to_first_token_seconds_count" in metrics and "tandem_num_requests_waiting" in metrics


def test_metrics_count_max_tokens_at_dispatch_and_finish(client, fake_cluster):
    # The planner predicts decode load from these: max_tokens arriving, and finished requests'
    # generated tokens beside their max_tokens (the share used).
    def counts() -> tuple[float, ...]:
        page = httpx.get(fake_cluster.http + "/metrics").text
        return tuple(metric(page, f"tandem_{name}_total")
                     for name in ("max_tokens_arrived", "max_tokens_finished", "generation_tokens"))

    before = counts()
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0)
    assert out.usage.completion_tokens == 6
    client.completions.create(model=MODEL, prompt="abc", max_tokens=5, n=2)
    assert [a - b for a, b in zip(counts(), before)] == [16.0, 16.0, 16.0]


def _post(base: str, path: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(base + path, content=content, headers={"content-type": "application/json", **(headers or {})})


def _assert_error(response: httpx.Response, status: int, error_type: str, *fragments: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == error_type
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


@pytest.mark.parametrize("path,body,fragments,param", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 300}, ["256", "300", "301", "1 in the prompt"],
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, ["temperature"], "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, ["max_tokens"], "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, ["vocabulary"], "prompt"),
    ("/v1/completions", {"model": MODEL}, ["prompt"], "prompt"),
    ("/v1/completions", "{not json", [], None),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, ["messages"], "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 99}, ["n"], "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     ["logprobs"], "top_logprobs"),
])
def test_bad_requests_get_400_with_openai_error_json(fake_cluster, path, body, fragments, param):
    error = _assert_error(_post(fake_cluster.http, path, body), 400, "invalid_request_error", *fragments)
    if param is not None:
        assert error["param"] == param


def test_unknown_model_is_404_and_router_stays_healthy(fake_cluster, client):
    error = _assert_error(_post(fake_cluster.http, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404,
                          "invalid_request_error", "gpt-9")
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-9' does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert httpx.get(fake_cluster.http + "/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="still fine", max_tokens=2).usage.completion_tokens == 2


def test_api_key_guards_http_and_grpc(loop_thread, tokenizer):
    cluster = loop_thread.run(start_fake_cluster(tokenizer, api_key="s3cret"))
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        _assert_error(_post(cluster.http, "/v1/completions", body), 401, "authentication_error")
        _assert_error(_post(cluster.http, "/v1/completions", body, {"authorization": "Bearer nope"}), 401,
                      "authentication_error")
        good = openai.OpenAI(base_url=cluster.http + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            openai.OpenAI(base_url=cluster.http + "/v1", api_key="bad", max_retries=0).models.list()
        from tandem_client import TandemClient, Unauthenticated
        with TandemClient(cluster.router.grpc_address, api_key="bad") as sdk, \
                pytest.raises(Unauthenticated, match="invalid API key"):
            sdk.generate("x", max_tokens=2)
        with TandemClient(cluster.router.grpc_address, api_key="s3cret") as sdk:
            assert sdk.generate("x", max_tokens=2).usage.completion_tokens == 2
    finally:
        loop_thread.run(stop_fake_cluster(cluster))


def _refused_while_one_waits(loop_thread, cluster, body) -> tuple[httpx.Response, threading.Thread]:
    """Post ``body`` once in a thread and, once it waits for its first token, again: the second
    answer, and the thread (join it)."""
    first = threading.Thread(target=_post, args=(cluster.http, "/v1/completions", body))
    first.start()
    loop_thread.run(until(lambda: cluster.router.dispatcher.num_waiting == 1))
    return _post(cluster.http, "/v1/completions", body), first


def test_full_waiting_queue_is_429_with_retry_after(loop_thread, tokenizer):
    cluster = loop_thread.run(start_fake_cluster(tokenizer, max_waiting=1,
                                                 decode_options={"token_interval_s": 1.0}))
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        response, first = _refused_while_one_waits(loop_thread, cluster, body)
        _assert_error(response, 429, "rate_limit_error", "max_waiting=1")
        page = samples(httpx.get(f"{cluster.http}/metrics").text)
        assert page['tandem_request_refused_total{limit="max_waiting"}'] == 1
        assert response.headers["retry-after"] == "1"
        first.join(10)
    finally:
        loop_thread.run(stop_fake_cluster(cluster))


def test_a_request_whose_first_token_would_come_too_late_is_429_and_one_on_an_empty_queue_is_taken(
        loop_thread, tokenizer):
    # Every first token takes one 0.4 s decode step: with one request waiting, a new one's
    # predicted wait is about 2 x 0.4 s, over the 0.6 s limit; alone it is taken at once.
    cluster = loop_thread.run(start_fake_cluster(tokenizer, max_predicted_wait_s=0.6,
                                                 decode_options={"token_interval_s": 0.4}))
    try:
        body = {"model": MODEL, "prompt": "a b c", "max_tokens": 1}
        for _ in range(MIN_DRAINED):   # alone each time: the queue learns its rate
            assert _post(cluster.http, "/v1/completions", body).status_code == 200
        response, first = _refused_while_one_waits(loop_thread, cluster, body)
        _assert_error(response, 429, "rate_limit_error", "max_predicted_wait_s=0.6")
        assert int(response.headers["retry-after"]) >= 1
        page = samples(httpx.get(f"{cluster.http}/metrics").text)
        assert page['tandem_request_refused_total{limit="max_predicted_wait_s"}'] == 1
        assert page['tandem_request_errors_total{status="429"}'] == 1
        first.join(10)
        assert _post(cluster.http, "/v1/completions", body).status_code == 200
    finally:
        loop_thread.run(stop_fake_cluster(cluster))


def test_a_slow_decode_pace_refuses_new_requests_until_it_recovers(loop_thread, tokenizer):
    # One 0.3 s decode step per token, over max_tpot_s=0.2: a request is taken while nothing
    # streams (no pace yet), refused while a long one streams at that pace, taken again once it ended.
    cluster = loop_thread.run(start_fake_cluster(tokenizer, max_tpot_s=0.2,
                                                 decode_options={"token_interval_s": 0.3}))
    try:
        long = threading.Thread(target=_post, args=(cluster.http, "/v1/completions",
                                                    {"model": MODEL, "prompt": "a", "max_tokens": 40}))
        long.start()
        body = {"model": MODEL, "prompt": "b", "max_tokens": 1}
        loop_thread.run(until(lambda: cluster.router.frontend.decode_pace.seconds_per_token() is not None,
                              timeout_s=20))
        response = _post(cluster.http, "/v1/completions", body)
        _assert_error(response, 429, "rate_limit_error", "max_tpot_s=0.2")
        page = samples(httpx.get(f"{cluster.http}/metrics").text)
        assert page['tandem_request_refused_total{limit="max_tpot_s"}'] == 1
        long.join(30)   # no stream runs now: the next request is taken at once, whatever the last pace was
        assert _post(cluster.http, "/v1/completions", body).status_code == 200
    finally:
        loop_thread.run(stop_fake_cluster(cluster))


def test_no_worker_of_a_role_is_503(loop_thread, tokenizer):
    async def start():
        return await Router(RouterConfig(model=MODEL, http_port=0, grpc_port=0), tokenizer).start()
    router = loop_thread.run(start())
    try:
        response = _post(f"http://{router.http_address}", "/v1/completions", {"model": MODEL, "prompt": "x"})
        _assert_error(response, 503, "service_unavailable", "no prefill worker")
        assert response.headers["retry-after"] == "1"   # a restart in progress: clients back off
        assert httpx.get(f"http://{router.http_address}/health").status_code == 503
    finally:
        loop_thread.run(router.stop())


def test_sse_events_decode_to_the_payload_and_keep_json_spelling_for_non_finite_logprobs():
    from router.http_api import _sse
    payload = {"id": "cmpl-1", "choices": [{"index": 0, "text": "héllo \"x\"\n", "logprobs": None,
                                            "finish_reason": None}], "usage": {"prompt_tokens": 3}}
    event = _sse(payload)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: "):]) == payload
    assert _sse({"logprob": float("-inf")}, exact_json=True) == b'data: {"logprob":-Infinity}\n\n'
