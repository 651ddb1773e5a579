"""Hostile tools, tool calls and output schemas: bounded, linear, and never a 500
(router/tool_choice.py, router/tool_calls.py, router/sampling.py, router/json_limits.py).

A request's tools are checked on the router's event loop: at most 128 of them, names of at most
64 characters given once, each tool and all of them bounded in JSON size and nesting, in time
linear in their size (the duplicate check was quadratic: ~20k tools held the loop for seconds).
Tool-call ``arguments`` nested past the recursion limit, from a client's earlier turn or from the
model, are text that is not a call, as invalid JSON is, not a RecursionError. A JSON schema
given as text (gRPC, vLLM's ``guided_json`` / ``structured_outputs.json``) is held to the same
nesting bound as a body: a deep one took the workers' grammar compiler most of a minute.
"""
from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import pytest

from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from router import tool_choice
from router.errors import RouterError
from router.json_limits import MAX_JSON_DEPTH, json_depth, loads_bounded
from router.tool_calls import ForcedParser, HermesParser, Llama3JsonParser
from router.tool_choice import MAX_TOOLS, ToolRequest, check_tools, prompt_inputs
from router.tool_formats import ToolFormat

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
DEEP_TEXT = "[" * 100_000 + "]" * 100_000      # json.loads of it raises RecursionError


def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    return {"type": "function", "function": function}


def array_schema(num_levels: int) -> dict:
    """A JSON schema of arrays in arrays; as JSON it nests 2 x num_levels + 1 deep."""
    schema: dict = {"type": "string"}
    for _ in range(num_levels):
        schema = {"type": "array", "items": schema}
    return schema


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.fixture(scope="module")
def cluster(fake_cluster):
    return fake_cluster   # tests/router/conftest.py: one router over a fake prefill and decode worker


def post(cluster, body: dict, timeout_s: float = 120.0) -> httpx.Response:
    return httpx.post(f"{cluster.http}{CHAT}", content=json.dumps(body), timeout=timeout_s,
                      headers={"content-type": "application/json"})


def param_of(response: httpx.Response, status: int) -> str | None:
    assert response.status_code == status, response.text[:500]
    return response.json()["error"]["param"]


# -- over HTTP ------------------------------------------------------------------------------------

def test_40k_tools_are_a_fast_400_and_health_stays_fast(cluster):
    """The old duplicate check (names.count per name) took ~8.7 s of event loop for 20k tools."""
    body = {"messages": HI, "max_tokens": 2, "tool_choice": "none", "tools": [tool(f"f{i}") for i in range(40_000)]}
    health_s: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set() and len(health_s) < 200:
            start = time.monotonic()
            httpx.get(f"{cluster.http}/health", timeout=60).raise_for_status()
            health_s.append(time.monotonic() - start)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    start = time.monotonic()
    try:
        response = post(cluster, body)
    finally:
        elapsed_s = time.monotonic() - start
        done.set()
        prober.join(60)
    assert param_of(response, 400) == "tools"
    assert elapsed_s < 15, elapsed_s
    assert health_s and max(health_s) < 5, health_s


@pytest.mark.parametrize("case, tools", [
    ("129-tools", [tool(f"f{i}") for i in range(MAX_TOOLS + 1)]),
    ("a-duplicate-name", [tool("f"), tool("g"), tool("f")]),
    ("a-tool-of-70k-chars", [tool("f", {"type": "object", "description": "x" * 70_000})]),
    ("tools-of-300k-chars", [tool(f"f{i}", {"type": "object", "description": "x" * 50_000}) for i in range(6)]),
    ("parameters-nested-200-deep", [tool("f", nested(200))]),
])
def test_tools_past_a_bound_are_a_400_naming_tools(cluster, case, tools):
    num_seen = [len(w.state.seen) for w in cluster.workers]
    assert param_of(post(cluster, {"messages": HI, "max_tokens": 2, "tool_choice": "none", "tools": tools}),
                    400) == "tools"
    assert [len(w.state.seen) for w in cluster.workers] == num_seen


def test_128_tools_are_served(cluster):
    body = {"messages": HI, "max_tokens": 2, "tool_choice": "none", "tools": [tool(f"f{i}") for i in range(128)]}
    assert post(cluster, body).status_code == 200


def test_an_earlier_call_with_arguments_nested_100k_deep_is_written_as_text(cluster):
    """The template without tool support writes earlier calls as text; json.loads of these
    arguments raised RecursionError, a 500. Now they are text, which gets as far as the context
    check: 200k characters are more than the fake workers' 256 tokens."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": DEEP_TEXT}}
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    response = post(cluster, {"messages": messages, "max_tokens": 2})
    assert param_of(response, 400) == "prompt"
    assert "maximum context length is 256 tokens" in response.json()["error"]["message"]


DEEP_SCHEMA = json.dumps(array_schema(150))


@pytest.mark.parametrize("field, param", [
    ({"guided_json": DEEP_SCHEMA}, "guided_json"),
    ({"structured_outputs": {"json": DEEP_SCHEMA}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": array_schema(150)}}},
     "response_format"),
])
def test_an_output_schema_nested_too_deep_is_a_400_naming_it(cluster, field, param):
    num_seen = [len(w.state.seen) for w in cluster.workers]
    assert param_of(post(cluster, {"messages": HI, "max_tokens": 2, **field}), 400) == param
    assert [len(w.state.seen) for w in cluster.workers] == num_seen


def test_a_grpc_schema_nested_too_deep_is_invalid_argument_and_a_shallower_one_is_served(cluster):
    def generate(schema: str) -> list:
        constraint = tandem_pb2.StructuredOutputs(json_schema=schema)
        sampling = tandem_pb2.Sampling(max_tokens=2, structured_outputs=constraint)
        with grpc.insecure_channel(cluster.router.grpc_address) as channel:
            return list(tandem_pb2_grpc.TandemStub(channel).Generate(
                tandem_pb2.CompletionRequest(prompt="hi", sampling=sampling), timeout=30))

    with pytest.raises(grpc.RpcError) as info:
        generate(DEEP_SCHEMA)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs: the JSON schema is nested more than 128 levels deep" in info.value.details()
    assert generate(json.dumps(array_schema(60)))[-1].finish_reason


# -- the checks themselves ------------------------------------------------------------------------

def test_the_tool_checks_are_linear_in_the_number_of_tools(monkeypatch):
    """With the count cap lifted: 50k distinct names take well under a second (names.count per
    name: ~2.5e9 comparisons, minutes)."""
    monkeypatch.setattr(tool_choice, "MAX_TOOLS", 10**6)
    monkeypatch.setattr(tool_choice, "MAX_TOOLS_CHARS", 10**9)
    tools = [tool(f"f{i}") for i in range(50_000)]
    start = time.monotonic()
    check_tools(tools)
    with pytest.raises(RouterError, match="two tools are named 'f0'"):
        check_tools([*tools, tool("f0")])
    assert time.monotonic() - start < 20


HERMES = ToolFormat("hermes", "test", True, frozenset())
NO_PARSER = ToolFormat("", "test", False, frozenset())


def test_from_openai_names_tools_for_each_bound():
    def refused(tools: list[dict]) -> str:
        with pytest.raises(RouterError) as info:
            ToolRequest.from_openai(tools, "none", None, HERMES)
        assert info.value.param == "tools"
        return str(info.value)

    assert "at most 128 tools, got 129" in refused([tool(f"f{i}") for i in range(129)])
    assert "1 to 64 characters" in refused([tool("n" * 65)])
    assert "two tools are named 'f'" in refused([tool("f"), tool("f")])
    assert "nested more than 128 levels deep" in refused([tool("f", nested(MAX_JSON_DEPTH))])
    assert ToolRequest.from_openai([tool("f", nested(MAX_JSON_DEPTH - 4))], "required", None, NO_PARSER).forced


def test_a_template_that_renders_tools_gets_deep_arguments_as_text():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP_TEXT}}
    messages, _ = prompt_inputs([{"role": "assistant", "content": "", "tool_calls": [call]}], None, True, "hermes")
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == DEEP_TEXT


# -- model output ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": ' + json.dumps(DEEP_TEXT) + "}</tool_call>",   # arguments as a string
    "<tool_call>" + DEEP_TEXT + "</tool_call>",
    '<tool_call>{"name": "f", "arguments": ' + json.dumps(nested(300)) + "}</tool_call>",
])
def test_hermes_output_nested_too_deep_is_content(text):
    parsed = HermesParser().parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])


def test_llama3_and_forced_output_nested_too_deep_is_content():
    text = '{"name": "f", "parameters": ' + json.dumps(DEEP_TEXT) + "}"
    parsed = Llama3JsonParser().parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])
    parsed = ForcedParser(None).parse(DEEP_TEXT)
    assert (parsed.content, parsed.tool_calls) == (DEEP_TEXT, [])


def test_loads_bounded_and_json_depth():
    assert json_depth(7) == 0 and json_depth({}) == 1 and json_depth({"a": [1, {"b": []}]}) == 4
    assert json_depth(nested(100_000)) == 100_000       # no recursion
    assert loads_bounded(DEEP_TEXT) is None
    assert loads_bounded(json.dumps(nested(MAX_JSON_DEPTH + 1)), "text") == "text"
    assert loads_bounded(json.dumps(nested(MAX_JSON_DEPTH))) == nested(MAX_JSON_DEPTH)
    assert loads_bounded("{bad", 1) == 1 and loads_bounded(None) is None
