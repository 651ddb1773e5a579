"""Black-box: hostile HTTP clients and bodies, second round (issue 27). Each gets an exact status
(and ``param``) or a closed connection within a bounded time, and the event loop stays free:
/health answers while the router refuses or answers them.

Against routers over fake workers (tests/router/fake_workers.py) on 127.0.0.1, with short
connection timeouts so that the slow-client cases take seconds.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from router.__main__ import parse_args
from router.config import RouterConfig
from tests.router.clusters import start_fake_cluster, stop_fake_cluster

C, CHAT = "/v1/completions", "/v1/chat/completions"
TIMEOUTS = {"http_header_timeout_s": 1.0, "http_body_timeout_s": 1.0, "http_min_body_rate": 64}
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def cluster(loop_thread, tokenizer):
    cluster = loop_thread.run(start_fake_cluster(tokenizer, max_sub_requests=16, tool_call_parser="hermes",
                                                 enable_auto_tool_choice=True,
                                                 decode_options={"max_model_len": MAX_MODEL_LEN}, **TIMEOUTS))
    for worker in cluster.prefills:   # the router takes the smallest max_model_len of all workers
        worker.state.max_model_len = MAX_MODEL_LEN
    deadline = time.monotonic() + 10
    while cluster.router.registry.max_model_len != MAX_MODEL_LEN and time.monotonic() < deadline:
        time.sleep(0.05)
    yield cluster
    loop_thread.run(stop_fake_cluster(cluster))


def post(base: str, path: str, body, headers: dict | None = None, timeout_s: float = 60.0) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(base + path, content=content, timeout=timeout_s,
                      headers={"content-type": "application/json", **(headers or {})})


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    return response.json()["error"]


def while_health_polled(cluster, send) -> tuple[object, float, float]:
    """``send()``'s result, how long it took, and the slowest /health answer meanwhile."""
    result: dict = {}

    def run() -> None:
        start = time.perf_counter()
        result["value"] = send()
        result["elapsed_s"] = time.perf_counter() - start
    sender = threading.Thread(target=run)
    slowest_s = 0.0
    with httpx.Client(base_url=cluster.http, timeout=60) as client:
        client.get("/health")
        sender.start()
        while sender.is_alive():
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            slowest_s = max(slowest_s, time.perf_counter() - start)
            time.sleep(0.005)
    sender.join()
    return result["value"], result["elapsed_s"], slowest_s


# -- bodies: counted before pydantic, templated off the loop -------------------------------------------

def test_three_million_one_token_prompts_are_refused_before_validation_and_health_stays_fast(cluster):
    # 12 MB: pydantic built 3M models first (seconds with the GIL held, +1.7 GB) before the 400.
    body = b'{"prompt": [' + b",".join([b"[1]"] * 3_000_000) + b"]}"
    response, elapsed_s, slowest_s = while_health_polled(cluster, lambda: post(cluster.http, C, body))
    assert slowest_s < 1.5, (slowest_s, elapsed_s)
    error = error_of(response, 400)
    assert error["param"] == "prompt" and "3000000 prompts, more than max_sub_requests=16" in error["message"]


class ParseSpy:
    """Records the size of every body the router process itself parses."""

    def __init__(self, monkeypatch) -> None:
        import router.http_api
        self.sizes: list[int] = []
        real = router.http_api.parse_body

        def spy(raw, model, check_sizes=None):
            self.sizes.append(len(raw))
            return real(raw, model, check_sizes)
        monkeypatch.setattr(router.http_api, "parse_body", spy)


def test_a_body_of_very_many_values_is_refused_by_the_child_and_never_parsed_in_the_router(cluster, monkeypatch):
    # 15 MB of 3M one-token text prompts: orjson took ~0.2-0.5 s with the GIL held in the router
    # (the loop answered nothing meanwhile) only to refuse the count. Now a child process parses it.
    spy = ParseSpy(monkeypatch)
    body = json.dumps({"prompt": ["a"] * 3_000_000, "max_tokens": 1}).encode()
    error = error_of(post(cluster.http, C, body), 400)
    assert error["param"] == "prompt" and "3000000 prompts, more than max_sub_requests=16" in error["message"]
    assert len(body) not in spy.sizes, spy.sizes
    # The same refusal, the same words, as the router's own check gives a small body.
    small = error_of(post(cluster.http, C, {"prompt": ["a"] * 17, "max_tokens": 1}), 400)
    assert small["message"] == error["message"].replace("3000000", "17")


def test_a_large_body_the_child_finds_nothing_wrong_with_is_served(cluster, monkeypatch):
    spy = ParseSpy(monkeypatch)
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "metadata": "," * 200_000 + "x" * (1 << 20)}).encode()
    response = post(cluster.http, C, body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert spy.sizes == [len(body)]          # checked in the child, then parsed here once


@pytest.mark.parametrize("case,body,param,fragment", [
    ("one-of-a-batch-past-the-context", {"prompt": [[1, 2], [1] * 2_000_000]}, "prompt.1",
     "maximum context length is 4096"),
    ("too-many-messages", {"messages": [{"role": "user", "content": ""}] * 100_000}, "messages", "100000 messages"),
])
def test_long_lists_are_refused_by_their_length_before_validation(cluster, case, body, param, fragment):
    response, elapsed_s, slowest_s = while_health_polled(cluster, lambda: post(cluster.http,
                                                                               CHAT if "messages" in body else C, body))
    assert slowest_s < 1.5, (slowest_s, elapsed_s)
    error = error_of(response, 400)
    assert error["param"] == param and fragment in error["message"], error


def test_a_huge_tool_schema_is_refused_without_stalling_the_loop(cluster):
    # This 3 MB tool description was templated and tokenized on the loop (seconds), then refused for
    # the context; now the tool size bound (router/tool_choice.py) refuses it, off the loop.
    tool = {"type": "function", "function": {"name": "f", "description": "lorem ipsum dolor sit amet " * 120_000,
                                             "parameters": {"type": "object", "properties": {}}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "auto"}
    response, elapsed_s, slowest_s = while_health_polled(cluster, lambda: post(cluster.http, CHAT, body))
    assert error_of(response, 400)["param"] == "tools"
    assert slowest_s < 0.25 + elapsed_s / 4, (slowest_s, elapsed_s)


def test_a_large_non_streaming_answer_is_built_off_the_loop(cluster):
    body = {"prompt": "x", "max_tokens": 4000, "n": 16, "logprobs": 20}
    response, elapsed_s, slowest_s = while_health_polled(cluster, lambda: post(cluster.http, C, body))
    assert response.status_code == 200, response.text[:300]
    choices = response.json()["choices"]
    assert [len(c["logprobs"]["top_logprobs"]) for c in choices] == [4000] * 16
    assert all(len(top) == 20 for c in choices for top in c["logprobs"]["top_logprobs"])
    assert slowest_s < 1.0, (slowest_s, elapsed_s)


def test_an_ignored_field_nested_700_deep_is_400_naming_it(cluster):
    body = b'{"prompt": "hi", "max_tokens": 1, "metadata": ' + b"[" * 700 + b"]" * 700 + b"}"
    error = error_of(post(cluster.http, C, body), 400)
    assert error["param"] == "metadata" and "nested more than 128 levels" in error["message"]
    # the same with json's spelling of a value orjson does not read
    body = b'{"prompt": "hi", "temperature": NaN, "x": ' + b"{\"a\": " * 700 + b"1" + b"}" * 700 + b"}"
    assert error_of(post(cluster.http, C, body), 400)["param"] == "x"


def test_client_strings_in_errors_are_clipped_and_escaped(cluster):
    error = error_of(post(cluster.http, C, {"prompt": "hi", "model": "m\n" * (2 << 20)}), 404)
    assert len(error["message"]) < 300 and "\n" not in error["message"]
    key = "k\r\n" * 100_000
    error = error_of(post(cluster.http, C, {"prompt": "hi", key: _nested(200)}), 400)
    assert len(error["param"]) < 700 and "\n" not in error["param"] and "\n" not in error["message"]


def _nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


# -- connections --------------------------------------------------------------------------------------

def _connect(cluster) -> socket.socket:
    host, port = cluster.router.http_address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (raises on limit_s)."""
    start = time.monotonic()
    sock.settimeout(limit_s)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def _status(data: bytes) -> int:
    return int(data.split(b" ", 2)[1])


def test_half_a_request_head_is_answered_408_and_closed(cluster):
    with _connect(cluster) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        data, closed_s = _read_until_closed(sock, 10)
    assert _status(data) == 408 and closed_s < 5, (data[:200], closed_s)


def test_a_silent_connection_is_closed(cluster):
    with _connect(cluster) as sock:
        data, closed_s = _read_until_closed(sock, 10)
    assert _status(data) == 408 and closed_s < 5


def test_a_stalled_upload_is_answered_408_and_closed(cluster):
    with _connect(cluster) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        data, closed_s = _read_until_closed(sock, 10)
    assert _status(data) == 408 and closed_s < 5, (data[:300], closed_s)
    assert b"--http-min-body-rate" in data


def test_an_upload_that_trickles_below_the_minimum_rate_is_408(cluster):
    # 64 bytes/s wanted; one byte every 0.2 s keeps the connection busy but is 5 bytes/s.
    with _connect(cluster) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n")
        start = time.monotonic()
        sent = 0
        try:
            while time.monotonic() - start < 8 and sent < 1000:
                sock.sendall(b" ")
                sent += 1
                time.sleep(0.2)
        except OSError:
            pass   # closed under us: the refusal
        data, _ = _read_until_closed(sock, 10)
    assert _status(data) == 408 and time.monotonic() - start < 8


def test_an_upload_at_a_normal_pace_goes_through(cluster):
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "user": "u" * 2000}).encode()
    with _connect(cluster) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 200):     # ~400 bytes/s for 5 s, above the 64 bytes/s floor
            sock.sendall(body[i:i + 200])
            time.sleep(0.5)
        data, _ = _read_until_closed(sock, 10)
    assert _status(data) == 200, data[:300]


@pytest.mark.parametrize("case,head,status", [
    ("4-MB-header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (4 << 20) + b"\r\n\r\n", 431),
    ("20000-headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 20_000 + b"\r\n", 431),
    ("101-headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 100 + b"\r\n", 431),
    ("20-KB-url", b"GET /health?" + b"q" * (20 << 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
])
def test_oversized_request_heads_are_refused_and_closed(cluster, case, head, status):
    with _connect(cluster) as sock:
        try:
            sock.sendall(head)
        except OSError:
            pass   # the server answered and closed before the whole head went out
        data, closed_s = _read_until_closed(sock, 10)
    assert _status(data) == status and closed_s < 5, data[:300]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"


def test_a_head_within_the_limits_is_served(cluster):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 98 + b"X-Big: " + b"a" * 30_000 + b"\r\n\r\n"
    with _connect(cluster) as sock:
        sock.sendall(head)
        assert _status(sock.recv(65536)) == 200


def test_connections_past_the_limit_get_503(loop_thread, tokenizer):
    cluster = loop_thread.run(start_fake_cluster(tokenizer, http_max_connections=4))
    try:
        idle = [_connect(cluster) for _ in range(4)]
        time.sleep(0.2)
        assert httpx.get(cluster.http + "/health").status_code == 503
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        assert httpx.get(cluster.http + "/health").status_code == 200
    finally:
        loop_thread.run(stop_fake_cluster(cluster))


def test_a_client_gone_mid_upload_is_one_line_without_a_traceback(cluster, caplog):
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        with _connect(cluster) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"prompt\": \"" + b"a" * 1000)
            time.sleep(0.1)
    deadline = time.monotonic() + 5
    while sum("during its upload" in r.getMessage() for r in caplog.records) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    gone = [r for r in caplog.records if "during its upload" in r.getMessage()]
    assert len(gone) == 3 and all(r.levelno == logging.INFO for r in gone)
    assert [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING] == []


# -- what a tenant can see ---------------------------------------------------------------------------

def test_metrics_and_cluster_with_an_api_key(loop_thread, tokenizer):
    cluster = loop_thread.run(start_fake_cluster(tokenizer, api_key="s3cret"))
    key = {"authorization": "Bearer s3cret"}
    try:
        assert error_of(httpx.get(cluster.http + "/metrics"), 401)["code"] == "invalid_api_key"
        metrics = httpx.get(cluster.http + "/metrics", headers=key)
        assert metrics.status_code == 200 and "tandem_num_requests_waiting" in metrics.text
        view = httpx.get(cluster.http + "/v1/cluster", headers=key)
        assert view.json() == {"roles": {"prefill": {"workers": 1, "healthy": 1},
                                         "decode": {"workers": 1, "healthy": 1}}}
        assert all(w.address not in view.text for w in cluster.workers)
    finally:
        loop_thread.run(stop_fake_cluster(cluster))
    cluster = loop_thread.run(start_fake_cluster(tokenizer, api_key="s3cret", metrics_without_api_key=True))
    try:
        assert httpx.get(cluster.http + "/metrics").status_code == 200
        assert error_of(httpx.get(cluster.http + "/v1/cluster"), 401)["code"] == "invalid_api_key"
    finally:
        loop_thread.run(stop_fake_cluster(cluster))


# -- flags --------------------------------------------------------------------------------------------

def test_http_flags_map_onto_the_config_and_are_checked():
    config = parse_args(["--http-header-timeout-s", "3", "--http-body-timeout-s", "4", "--http-min-body-rate", "5",
                         "--http-keep-alive-timeout-s", "6", "--http-max-connections", "7",
                         "--metrics-without-api-key"])
    assert (config.http_header_timeout_s, config.http_body_timeout_s, config.http_min_body_rate,
            config.http_keep_alive_timeout_s, config.http_max_connections,
            config.metrics_without_api_key) == (3.0, 4.0, 5, 6.0, 7, True)
    for field, value in (("http_header_timeout_s", 0), ("http_body_timeout_s", -1), ("http_min_body_rate", -1),
                         ("http_keep_alive_timeout_s", 0), ("http_max_connections", 0)):
        with pytest.raises(ValueError, match=field):
            RouterConfig(**{field: value})
