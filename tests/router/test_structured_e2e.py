"""Structured output end to end: the router in-process, real prefill and decode worker processes
on SmolLM2, the unmodified ``openai`` client and the gRPC SDK. Every output validates against its
schema (HTTP chat and completions, streaming and not, greedy and seeded); a constraint the workers
cannot compile is a 400 / INVALID_ARGUMENT before any stream byte; and a decode worker killed
mid-stream leaves every constrained stream complete, valid and equal to the undisturbed text (the
retry's workers resume their matchers from the tokens already streamed)."""
from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import openai
import pytest

from protos.tandem.v1 import tandem_pb2
from tandem_client import InvalidArgument, TandemClient
from tests.router.clusters import real_cluster

pytestmark = pytest.mark.slow
NAME = "smol"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Oslo", "Lima"]}},
          "required": ["name", "age", "city"]}
# Long enough (about 40 tokens) that a kill after the first chunk lands mid-stream.
TEAM = {"type": "object",
        "properties": {"team": {"type": "string", "maxLength": 16},
                       "members": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                   "minItems": 4, "maxItems": 4}},
        "required": ["team", "members"]}


@pytest.fixture(scope="module")
def cluster(smollm2_gguf, tmp_path_factory, loop_thread):
    yield from real_cluster(loop_thread, smollm2_gguf, ("prefill", "decode", "decode"),
                            tmp_path_factory.mktemp("structured-e2e"), NAME, "--num-gpu-blocks-override", "128",
                            "--max-model-len", "512")


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="x", max_retries=0, timeout=180)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _stream_chat(client, messages, **kwargs) -> tuple[str, str]:
    parts, finish = [], None
    for chunk in client.chat.completions.create(model=NAME, messages=messages, stream=True, **kwargs):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


def test_openai_client_json_schema_is_valid_json(cluster):
    router, _ = cluster
    client = _client(router)
    prompts = ["Describe a person as JSON.", "Who lives in Lima?", "Tell me about a teacher."]
    for i, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt}]
        sampled = {"temperature": 0.0} if i == 0 else {"temperature": 1.0, "seed": i}
        response = client.chat.completions.create(model=NAME, messages=messages, max_tokens=48,
                                                  response_format=_schema_format(PERSON), **sampled)
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        text, finish = _stream_chat(client, messages, max_tokens=48, response_format=_schema_format(PERSON),
                                    **sampled)
        assert finish == "stop" and text == choice.message.content   # same tokens streamed or not
    obj = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "A JSON object"}],
                                         max_tokens=64, temperature=0.0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].finish_reason == "length"


def test_completions_with_vllm_extras(cluster):
    router, _ = cluster
    client = _client(router)
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}"
    out = client.completions.create(model=NAME, prompt="Name and age:", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"guided_regex": pattern})
    assert out.choices[0].finish_reason == "stop" and re.fullmatch(pattern, out.choices[0].text)
    parts = [c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="Is the sky blue?", max_tokens=10, temperature=0.0, stream=True,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})]
    assert "".join(parts) in ("yes", "no")
    out = client.completions.create(model=NAME, prompt="Person:", max_tokens=48, temperature=0.0,
                                    extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)
    # Too few tokens to finish the object: "length", never a broken object called "stop".
    out = client.completions.create(model=NAME, prompt="Person:", max_tokens=5, temperature=0.0,
                                    extra_body={"guided_json": PERSON})
    assert out.choices[0].finish_reason == "length"


def test_grpc_structured_outputs(cluster):
    router, _ = cluster
    constraint = tandem_pb2.StructuredOutputs(json_schema=json.dumps(PERSON))
    with TandemClient(router.grpc_address) as sdk:
        done = sdk.chat([{"role": "user", "content": "A person"}], temperature=1.0, seed=11, max_tokens=48,
                        structured_outputs=constraint)
        assert done.finish_reason == "stop"
        jsonschema.validate(json.loads(done.text), PERSON)
        with pytest.raises(InvalidArgument, match="invalid json_schema"):
            list(sdk.chat_stream([{"role": "user", "content": "x"}], max_tokens=8,
                                 structured_outputs=tandem_pb2.StructuredOutputs(json_schema='{"type": "nope"}')))
        with pytest.raises(InvalidArgument, match="structured_outputs"):
            sdk.generate("x", max_tokens=8, structured_outputs=tandem_pb2.StructuredOutputs(choice={}))


@pytest.mark.parametrize("stream", [False, True])
def test_invalid_schema_is_a_400_before_any_byte(cluster, stream):
    router, _ = cluster
    url = f"http://{router.http_address}/v1/chat/completions"
    base = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream}
    bad = [({"response_format": _schema_format({"type": "object", "properties": {"a": {"$ref": "#/missing"}}})},
            "worker: invalid json_schema"),                                   # only xgrammar can tell
           ({"guided_regex": "(unclosed"}, "worker: invalid regex"),
           ({"guided_regex": "[^x]" * 1000}, "worker: invalid regex: the regex is too costly to compile"),  # was 5 s
           ({"response_format": _schema_format({"type": "object", "properties": {
               f"p{i}": {"type": "string", "maxLength": 100 + i} for i in range(4)}})},
            "worker: invalid json_schema: the json_schema is too costly to compile"),  # was 6 s of compile
           ({"guided_json": "{not json"}, "guided_json"),                     # the router tells
           ({"response_format": {"type": "json_schema"}}, "json_schema")]
    for extra, message in bad:
        response = httpx.post(url, json={**base, **extra}, timeout=120)
        assert response.status_code == 400, response.text
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert message in error["message"]
        if message.startswith("worker:"):
            assert error["param"] is None      # the router cannot tell which field the worker refused


def test_decode_worker_killed_mid_stream_keeps_outputs_valid(cluster):
    router, workers = cluster
    client = _client(router)
    prompts = [f"Team number {i} and its members" for i in range(4)]
    fmt = _schema_format(TEAM)

    def messages(p):
        return [{"role": "user", "content": p}]
    expected = [client.chat.completions.create(model=NAME, messages=messages(p), max_tokens=80, temperature=0.0,
                                               response_format=fmt).choices[0].message.content for p in prompts]
    results: list[tuple[str, str] | None] = [None] * len(prompts)
    started = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        parts, finish, first = [], None, True
        for chunk in client.chat.completions.create(model=NAME, messages=messages(prompts[i]), max_tokens=80,
                                                    temperature=0.0, response_format=fmt, stream=True):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if first and "".join(parts):
                first = False
                started.wait(120)
        results[i] = ("".join(parts), finish)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    before = router.metrics.failovers._value.get()
    started.wait(120)                  # every stream has its first text
    workers["decode"][0].kill()
    for t in threads:
        t.join(180)
    for (text, finish), want in zip(results, expected):
        assert finish == "stop"
        jsonschema.validate(json.loads(text), TEAM)
        assert text == want            # greedy: the resumed matcher continued the same tokens
    assert router.metrics.failovers._value.get() > before
