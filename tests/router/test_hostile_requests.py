"""Black-box: malformed and hostile requests over HTTP and gRPC each get a 4xx (INVALID_ARGUMENT and
friends on gRPC) naming the field, before any stream byte, and the router keeps serving.

Most run against a router over fake workers with small limits; the last test starts the real
``tandem serve`` on the tiny random model and checks that /health stays fast and the workers'
KV blocks all return while bad requests are refused.
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time

import grpc
import httpx
import pytest

from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tests.router.clusters import fake_cluster_running, start_fake_cluster, stop_fake_cluster
from tests.router.hostile_cases import GRPC_CASES, LIMITS, completion_request

C, CHAT = "/v1/completions", "/v1/chat/completions"
VOCAB = 49152
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster(loop_thread, tokenizer):
    with fake_cluster_running(loop_thread, tokenizer, **LIMITS) as cluster:
        yield cluster


def post(base: str, path: str, body, headers: dict | None = None, timeout_s: float = 30.0) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)   # ensure_ascii keeps surrogates as \\ud800
    return httpx.post(base + path, content=content, timeout=timeout_s,
                      headers={"content-type": "application/json", **(headers or {})})


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def raw(body: str) -> bytes:
    return body.encode()


# (case, path, body, status, param)
HTTP_CASES = [
    ("surrogate-in-prompt", C, {"prompt": "a\ud800b"}, 400, "prompt"),
    ("surrogate-in-batch-prompt", C, {"prompt": ["ok", "\udfff"]}, 400, "prompt.1"),
    ("surrogate-in-chat-content", CHAT, {"messages": [{"role": "user", "content": "x\ud83d"}]}, 400,
     "messages.0.content"),
    ("surrogate-in-chat-role", CHAT, {"messages": [{"role": "\udc00", "content": "x"}]}, 400, "messages.0.role"),
    ("surrogate-in-content-part", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, 400,
     "messages.0.content.0.text"),
    ("surrogate-in-stop", C, {"prompt": "hi", "stop": ["ok", "\ud800"]}, 400, "stop.1"),
    ("surrogate-in-request-id", C, {"prompt": "hi", "request_id": "r\ud800"}, 400, "request_id"),
    ("surrogate-in-model", C, {"prompt": "hi", "model": "\ud800"}, 400, "model"),
    ("surrogate-in-a-key", C, {"prompt": "hi", "\ud800": 1}, 400, None),
    ("bytes-not-utf8", C, b'{"prompt": "\xff\xfe"}', 400, None),
    ("not-json", C, b"{prompt: hi", 400, None),
    ("json-array", C, b"[1, 2]", 400, None),
    ("nesting-200k-deep", C, b"[" * 200_000, 400, None),
    ("seed-plus-n-past-int64", C, {"prompt": "hi", "n": 2, "seed": 2**63 - 1}, 400, "seed"),
    ("seed-past-int64", C, {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("seed-negative", CHAT, {"messages": HI, "seed": -1}, 400, "seed"),
    ("stop-token-id-past-int64", C, {"prompt": "hi", "stop_token_ids": [2**64]}, 400, "stop_token_ids"),
    ("stop-token-id-past-vocab", C, {"prompt": "hi", "stop_token_ids": [VOCAB]}, 400, "stop_token_ids"),
    ("stop-token-id-negative", CHAT, {"messages": HI, "stop_token_ids": [-5]}, 400, "stop_token_ids"),
    ("too-many-stop-token-ids", C, {"prompt": "hi", "stop_token_ids": list(range(129))}, 400, "stop_token_ids"),
    ("too-many-stop-strings", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("stop-string-too-long", C, {"prompt": "hi", "stop": "x" * 257}, 400, "stop"),
    ("stop-string-empty", CHAT, {"messages": HI, "stop": [""]}, 400, "stop"),
    ("temperature-infinity", C, raw('{"prompt": "hi", "temperature": 1e999}'), 400, "temperature"),
    ("temperature-nan", C, raw('{"prompt": "hi", "temperature": NaN}'), 400, "temperature"),
    ("temperature-past-float32", C, {"prompt": "hi", "temperature": 1e300}, 400, "temperature"),
    ("top-p-denormal-rounds-to-0", C, {"prompt": "hi", "top_p": 5e-324}, 400, "top_p"),
    ("repetition-penalty-denormal", C, {"prompt": "hi", "repetition_penalty": 1e-40}, 400, "repetition_penalty"),
    ("presence-penalty-huge", CHAT, {"messages": HI, "presence_penalty": 1e308}, 400, "presence_penalty"),
    ("max-tokens-past-int32", C, {"prompt": "hi", "max_tokens": 2**31}, 400, "max_tokens"),
    ("max-tokens-10e30", CHAT, {"messages": HI, "max_tokens": 10**30}, 400, "max_tokens"),
    ("top-k-past-int32", C, {"prompt": "hi", "top_k": 2**40}, 400, "top_k"),
    ("logprobs-10e20", C, {"prompt": "hi", "logprobs": 10**20}, 400, "logprobs"),
    ("n-zero", C, {"prompt": "hi", "n": 0}, 400, "n"),
    ("n-10e30", CHAT, {"messages": HI, "n": 10**30}, 400, "n"),
    ("n-fractional", C, {"prompt": "hi", "n": 1.5}, 400, "n"),
    ("prompts-times-n-over-cap", C, {"prompt": ["a"] * 5, "n": 2}, 400, "n"),
    ("prompts-over-cap", C, {"prompt": ["a"] * 9}, 400, "prompt"),
    ("prompt-token-id-past-int64", C, {"prompt": [1, 2**64]}, 400, "prompt"),
    ("batch-token-id-past-vocab", C, {"prompt": [[1, 2], [3, 10**20]]}, 400, "prompt"),
    ("prompt-over-char-cap", C, {"prompt": "x" * 100_001}, 400, "prompt"),
    ("chat-over-char-cap", CHAT, {"messages": [{"role": "user", "content": "y" * 60_000}] * 2}, 400, "messages"),
    ("request-id-too-long", C, {"prompt": "hi", "request_id": "r" * 201}, 400, "request_id"),
    ("messages-not-a-list", CHAT, {"messages": "hi"}, 400, "messages"),
    ("content-not-text", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("echo", C, {"prompt": "hi", "echo": True}, 400, "echo"),
    ("body-over-limit", C, {"prompt": "z" * (300 << 10)}, 413, None),
    ("bad-value-on-a-stream", C, {"prompt": "hi", "stream": True, "temperature": -1}, 400, "temperature"),
    ("bad-value-on-a-chat-stream", CHAT, {"messages": HI, "stream": True, "stop_token_ids": [VOCAB]}, 400,
     "stop_token_ids"),
]


# Cases the router refused before this suite existed stay as regression cases, apart from the
# ones that got a 500, a dropped connection or no ``param`` until then.
REFUSED_BEFORE_HTTP = {
    "json-array", "seed-past-int64", "seed-negative", "stop-token-id-negative", "too-many-stop-strings",
    "stop-string-too-long", "stop-string-empty", "temperature-infinity", "temperature-nan",
    "temperature-past-float32", "top-p-denormal-rounds-to-0", "presence-penalty-huge",
    "max-tokens-past-int32", "max-tokens-10e30", "top-k-past-int32", "logprobs-10e20", "n-zero", "n-10e30",
    "n-fractional", "prompt-token-id-past-int64", "batch-token-id-past-vocab", "prompt-over-char-cap",
    "request-id-too-long", "messages-not-a-list", "echo", "bad-value-on-a-stream"
}
NEW_HTTP = [c for c in HTTP_CASES if c[0] not in REFUSED_BEFORE_HTTP]
REGRESSION_HTTP = [c for c in HTTP_CASES if c[0] in REFUSED_BEFORE_HTTP]


def _check_http(cluster, path, body, status, param) -> None:
    num_seen = [len(w.state.seen) for w in cluster.workers]
    error = error_of(post(cluster.http, path, body), status)
    assert error["param"] == param, error
    assert [len(w.state.seen) for w in cluster.workers] == num_seen    # no worker heard of it


@pytest.mark.parametrize("case,path,body,status,param", NEW_HTTP, ids=[c[0] for c in NEW_HTTP])
def test_hostile_http_request_gets_4xx_naming_the_field(cluster, case, path, body, status, param):
    _check_http(cluster, path, body, status, param)


@pytest.mark.parametrize("case,path,body,status,param", REGRESSION_HTTP, ids=[c[0] for c in REGRESSION_HTTP])
def test_malformed_http_request_refused_before_still_gets_4xx_naming_the_field(cluster, case, path, body, status,
                                                                              param):
    _check_http(cluster, path, body, status, param)


def _grpc_error(call, match: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError, match=match) as info:
        list(call())
    return info.value


REFUSED_BEFORE_GRPC = {
    "prompt-and-token-ids", "temperature-nan", "temperature-inf", "top-p-zero", "too-many-stop-strings",
    "seed-negative", "max-tokens-negative", "token-id-past-vocab", "request-id-too-long", "chat-empty",
    "unknown-model"
}
NEW_GRPC = [c for c in GRPC_CASES if c[0] not in REFUSED_BEFORE_GRPC]
REGRESSION_GRPC = [c for c in GRPC_CASES if c[0] in REFUSED_BEFORE_GRPC]


def _check_grpc(cluster, method, request_msg, code, field) -> None:
    with grpc.insecure_channel(cluster.router.grpc_address) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)
        error = _grpc_error(lambda: getattr(stub, method)(request_msg, timeout=30), re.escape(field))
    assert error.code() == code, error.details()
    assert field in error.details()


@pytest.mark.parametrize("case,method,request_msg,code,field", NEW_GRPC, ids=[c[0] for c in NEW_GRPC])
def test_hostile_grpc_request_gets_a_clean_status_naming_the_field(cluster, case, method, request_msg, code, field):
    _check_grpc(cluster, method, request_msg, code, field)


@pytest.mark.parametrize("case,method,request_msg,code,field", REGRESSION_GRPC, ids=[c[0] for c in REGRESSION_GRPC])
def test_malformed_grpc_request_refused_before_still_gets_its_status(cluster, case, method, request_msg, code, field):
    _check_grpc(cluster, method, request_msg, code, field)


def test_grpc_prompt_that_is_not_utf8_is_invalid_argument(cluster):
    # Field 2 (prompt), length-delimited, two bytes that are not UTF-8: no protobuf library
    # writes this, a hostile client can.
    body = bytes([0x12, 2, 0xFF, 0xFE])
    with grpc.insecure_channel(cluster.router.grpc_address) as channel:
        call = channel.unary_stream("/tandem.v1.Tandem/Generate", request_serializer=lambda b: b,
                                    response_deserializer=tandem_pb2.CompletionChunk.FromString)
        error = _grpc_error(lambda: call(body, timeout=30), "the request is not a valid message")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())


def _raw_http(address: str, head: str, body: bytes = b"", timeout_s: float = 5.0) -> tuple[int, bytes]:
    """Status and body of a hand-written request (headers may promise more body than is sent)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1]


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def test_oversized_body_is_413_from_its_content_length_before_it_is_read(cluster):
    # 10 MB promised, 10 bytes sent: an answer can only come from the header.
    status, body = _raw_http(cluster.router.http_address, f"POST {C} HTTP/1.1\r\nHost: x\r\n"
                             "Content-Type: application/json\r\nContent-Length: 10000000", b'{"prompt":')
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413(cluster):
    chunk = b"a" * (64 << 10)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(5))
    status, body = _raw_http(cluster.router.http_address, f"POST {C} HTTP/1.1\r\nHost: x\r\n"
                             "Content-Type: application/json\r\nTransfer-Encoding: chunked", chunks)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


def test_api_key_is_checked_before_the_body_is_read(loop_thread, tokenizer):
    cluster = loop_thread.run(start_fake_cluster(tokenizer, api_key="s3cret"))
    try:
        status, body = _raw_http(cluster.router.http_address, f"POST {C} HTTP/1.1\r\nHost: x\r\n"
                                 "Content-Type: application/json\r\nContent-Length: 1000", b'{"prompt":')
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    finally:
        loop_thread.run(stop_fake_cluster(cluster))


def test_host_header_outside_the_allow_list_is_refused_and_health_stays_open(loop_thread, tokenizer):
    cluster = loop_thread.run(start_fake_cluster(tokenizer, allowed_hosts=("localhost", "api.example.com:8000")))
    try:
        body = {"prompt": "x", "max_tokens": 1}
        error = error_of(post(cluster.http, C, body, {"host": "evil.example.com"}), 400)
        assert error["code"] == "host_not_allowed" and error["param"] is None
        assert error_of(httpx.get(cluster.http + "/metrics", headers={"host": "evil.example.com"}), 400)
        wrong_port = post(cluster.http, C, body, {"host": "api.example.com:9999"})
        assert error_of(wrong_port, 400)["code"] == "host_not_allowed"
        for host in ("localhost", "LOCALHOST:1234", "api.example.com:8000"):
            assert post(cluster.http, C, body, {"host": host}).status_code == 200, host
        assert httpx.get(cluster.http + "/health", headers={"host": "evil.example.com"}).status_code == 200
    finally:
        loop_thread.run(stop_fake_cluster(cluster))


def test_queued_sub_requests_over_max_waiting_is_429_with_retry_after(loop_thread, tokenizer):
    cluster = loop_thread.run(start_fake_cluster(tokenizer, max_waiting=4, decode_options={"token_interval_s": 2.0}))
    try:
        first = threading.Thread(target=post, args=(cluster.http, C, {"prompt": "x", "max_tokens": 1, "n": 3}))
        first.start()
        deadline = time.monotonic() + 10
        while cluster.router.dispatcher.num_waiting < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        response = post(cluster.http, C, {"prompt": ["x", "y"], "max_tokens": 1})
        error = error_of(response, 429)
        assert error["code"] == "queue_full" and response.headers["retry-after"] == "1"
        assert "3 waiting + 2 new > max_waiting=4" in error["message"]
        first.join(15)
    finally:
        loop_thread.run(stop_fake_cluster(cluster))


def test_non_streaming_request_whose_client_disconnects_is_aborted_at_both_workers(loop_thread, tokenizer):
    cluster = loop_thread.run(start_fake_cluster(tokenizer, decode_options={"token_interval_s": 0.05}))
    try:
        body = json.dumps({"prompt": "x", "max_tokens": 200, "request_id": "gone-1"}).encode()
        host, port = cluster.router.http_address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + 5
            while not cluster.decodes[0].state.active and time.monotonic() < deadline:
                time.sleep(0.01)
            [internal_id] = cluster.decodes[0].state.active    # the router's id made from "gone-1"
            assert internal_id.startswith("gone-1")
        deadline = time.monotonic() + 5    # 200 tokens would take 10 s
        while (cluster.decodes[0].state.active or internal_id not in cluster.prefills[0].state.aborted) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cluster.decodes[0].state.active == set()
        assert internal_id in cluster.decodes[0].state.aborted and internal_id in cluster.prefills[0].state.aborted
    finally:
        loop_thread.run(stop_fake_cluster(cluster))


def test_health_answers_in_milliseconds_while_a_huge_prompt_is_tokenized_and_refused(cluster):
    # ~100k characters of text is some 100 ms of tokenizing here; the context is 256 tokens.
    body = {"messages": [{"role": "user", "content": "hello world, a prompt " * 4500}]}
    result: dict = {}

    def send() -> None:
        start = time.perf_counter()
        result["response"] = post(cluster.http, CHAT, body)
        result["elapsed_s"] = time.perf_counter() - start
    sender = threading.Thread(target=send)
    latencies = []
    with httpx.Client(base_url=cluster.http) as client:
        client.get("/health")
        sender.start()
        while sender.is_alive():
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
    sender.join()
    assert error_of(result["response"], 400)["param"] == "prompt"
    assert latencies and max(latencies) < 0.05 + result["elapsed_s"] / 4, (max(latencies), result["elapsed_s"])


# -- the real thing ------------------------------------------------------------------------------

@pytest.mark.slow
def test_real_serve_refuses_hostile_requests_keeps_health_fast_and_frees_every_block(tmp_path, tiny_model_dir):
    from tests.deploy.serving import interrupt, start_serve, wait_for
    dep = start_serve(tmp_path, "--model", str(tiny_model_dir("llama")), "--kv-cache-memory", str(64 << 20),
                      "--max-model-len", "256", "--dtype", "float32")
    try:
        grpc_address = dep.grpc
        bad = [(C, {"prompt": "x\ud800"}, 400, "prompt"),
               (C, raw('{"prompt": "hi", "temperature": NaN}'), 400, "temperature"),
               (CHAT, {"messages": HI, "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
               (C, {"prompt": "hi", "n": 2, "seed": 2**63 - 1}, 400, "seed"),
               (C, {"prompt": "hi", "stream": True, "max_tokens": 2**40}, 400, "max_tokens"),
               (C, b"z" * (17 << 20), 413, None)]
        for path, body, status, param in bad:
            assert error_of(post(dep.http, path, body), status)["param"] == param, (path, status)
        with grpc.insecure_channel(grpc_address) as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            infinite = completion_request(sampling={"temperature": float("inf")})
            error = _grpc_error(lambda: stub.Generate(infinite, timeout=30), "temperature")
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in error.details()
            call = channel.unary_stream("/tandem.v1.Tandem/Generate", request_serializer=lambda b: b,
                                        response_deserializer=tandem_pb2.CompletionChunk.FromString)
            assert _grpc_error(lambda: call(bytes([0x12, 1, 0xFF]), timeout=30),
                               "the request is not a valid message").code() == \
                grpc.StatusCode.INVALID_ARGUMENT

        # Clients that leave mid-request: one non-streaming, one streaming.
        for stream in (False, True):
            body = json.dumps({"prompt": "tell me a story", "max_tokens": 200, "ignore_eos": True, "stream": stream})
            host, port = dep.http.removeprefix("http://").rsplit(":", 1)
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
                time.sleep(0.1)   # the tiny model makes 200 tokens in about a second: leave mid-way

        # /health stays fast while a prompt far over max_model_len is tokenized and refused.
        result = {}
        sender = threading.Thread(target=lambda: result.update(
            response=post(dep.http, CHAT, {"messages": [{"role": "user", "content": "many words here " * 60_000}]})))
        latencies = []
        with httpx.Client(base_url=dep.http) as client:
            sender.start()
            while sender.is_alive():
                start = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.01)
        sender.join()
        assert error_of(result["response"], 400)["param"] == "prompt"
        assert len(latencies) >= 3 and sorted(latencies)[len(latencies) // 2] < 0.05 and max(latencies) < 0.5, latencies

        wait_for(lambda: all(w["kv_blocks_used"] == 0 and w["num_running"] == 0 for w in _workers(dep.http)),
                 "every worker's KV blocks returned", timeout_s=60, dep=dep)
        good = post(dep.http, C, {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}).json()
        assert good["usage"]["completion_tokens"] == 3
    finally:
        interrupt(dep.proc)


def _workers(http: str) -> list[dict]:
    """The workers as the router last saw them in their Stats (kv_blocks_used, num_running)."""
    return httpx.get(http + "/v1/cluster", timeout=10).json()["workers"]
