"""``cache_salt`` end to end: a tenant cannot learn from ``cached_tokens`` that someone else sent
a prompt prefix (the vLLM CVE-2025-46570 class) unless both use one salt.

The salt goes in the HTTP body of /v1/completions and /v1/chat/completions or in the public
gRPC ``Sampling``; the router checks it (1 to 256 characters, else 400 / INVALID_ARGUMENT naming
``cache_salt``) and the workers mix it into the hash of the prompt's first KV block. Checked over
real worker processes on the tiny random model, on both paths a prompt can take: a prefill /
decode pair (the prefill worker's cache) and a short prompt the decode worker prefills itself.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from router.server import Router
from tandem_client import TandemClient
from tests.models import random_prompt
from tests.router.clusters import real_cluster, start_fake_cluster, stop_fake_cluster

C, CHAT = "/v1/completions", "/v1/chat/completions"
NAME = "tiny"
LOCAL_MAX_TOKENS = 24
LONG = random_prompt(seed=71, num_tokens=40)    # a prefill / decode pair; 2 full blocks may hit
SHORT = random_prompt(seed=72, num_tokens=20)   # prefilled by the decode worker; 1 full block may hit
WORDS = " ".join(f"w{i}" for i in range(40))    # a chat prompt of several 16-token blocks


def _post(address: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://{address}{path}", content=json.dumps(body), timeout=120,
                      headers={"content-type": "application/json"})


# -- the router's checks (fake workers) ----------------------------------------------------------

@pytest.fixture(scope="module")
def fake(loop_thread, tokenizer):
    cluster = loop_thread.run(start_fake_cluster(tokenizer))
    yield cluster
    loop_thread.run(stop_fake_cluster(cluster))


@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize("salt", ["", "s" * 257, 5, ["a"]], ids=["empty", "257-chars", "number", "list"])
def test_a_bad_http_cache_salt_is_a_400_naming_it(fake, path, salt):
    body = {"prompt": "hi"} if path == C else {"messages": [{"role": "user", "content": "hi"}]}
    num_seen = [len(w.state.seen) for w in fake.workers]
    response = _post(fake.router.http_address, path, {**body, "max_tokens": 2, "cache_salt": salt})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"
    assert [len(w.state.seen) for w in fake.workers] == num_seen    # no worker heard of it


@pytest.mark.parametrize("salt", ["", "s" * 257])
def test_a_bad_grpc_cache_salt_is_invalid_argument(fake, salt):
    request = tandem_pb2.CompletionRequest(prompt="hi", sampling=tandem_pb2.Sampling(max_tokens=2, cache_salt=salt))
    with grpc.insecure_channel(fake.router.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(tandem_pb2_grpc.TandemStub(channel).Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt must be 1 to 256 characters" in info.value.details()


def test_a_salt_of_256_characters_is_served(fake):
    response = _post(fake.router.http_address, C, {"prompt": "hi", "max_tokens": 2, "cache_salt": "s" * 256})
    assert response.status_code == 200, response.text


# -- real workers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory, loop_thread) -> Iterator[Router]:
    for router, _ in real_cluster(loop_thread, tiny_model_dir("llama"), ("prefill", "decode"),
                                  tmp_path_factory.mktemp("cache-salt"), NAME, "--num-gpu-blocks-override", "64",
                                  local_prefill_max_tokens=LOCAL_MAX_TOKENS):
        yield router


def _cached(sdk: TandemClient, prompt, salt: str | None = None) -> int:
    options = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True, "cache_salt": salt}
    if isinstance(prompt, str):
        out = sdk.chat([{"role": "user", "content": prompt}], **options)
    else:
        out = sdk.generate(prompt, **options)
    return out.usage.cached_tokens


@pytest.mark.slow
def test_cached_tokens_are_shared_only_within_one_salt(cluster):
    start_s = time.monotonic()
    with TandemClient(cluster.grpc_address) as sdk:
        # A prefill / decode pair: the prefill worker's cache.
        ok = _post(cluster.http_address, C, {"prompt": LONG, "max_tokens": 2, "temperature": 0,
                                             "cache_salt": "tenant-a"})
        assert ok.status_code == 200, ok.text
        assert _cached(sdk, LONG, "tenant-b") == 0       # tenant b cannot see that tenant a sent it
        assert _cached(sdk, LONG) == 0                   # nor can an unsalted request
        assert _cached(sdk, LONG, "tenant-a") == 32      # tenant a shares with itself (HTTP's salt arrived)
        assert _cached(sdk, LONG) == 32                  # unsalted requests share as before
        assert _cached(sdk, LONG, "tenant-b") == 32

        # A prompt the decode worker prefills itself: its cache is salted the same way.
        assert len(SHORT) <= LOCAL_MAX_TOKENS < len(LONG)
        assert _cached(sdk, SHORT, "tenant-a") == 0
        assert _cached(sdk, SHORT, "tenant-b") == 0
        assert _cached(sdk, SHORT) == 0
        assert _cached(sdk, SHORT, "tenant-a") == 16

        # Chat over HTTP carries the salt too.
        chat = _post(cluster.http_address, CHAT, {"messages": [{"role": "user", "content": WORDS}], "max_tokens": 2,
                                                  "temperature": 0, "cache_salt": "tenant-c"})
        assert chat.status_code == 200, chat.text
        assert _cached(sdk, WORDS, "tenant-d") == 0
        assert _cached(sdk, WORDS) == 0
        assert _cached(sdk, WORDS, "tenant-c") >= 32
    assert time.monotonic() - start_s < 120
