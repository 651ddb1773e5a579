"""Grammar compiles are bounded, shared and cached by size (engine.structured, engine.grammar_limits).

A constraint whose compile would take seconds to minutes (deep nesting, many length-bounded
strings, long runs of character classes, nested stars, thousands of optional properties) is a
ValueError before xgrammar compiles it; each hostile case here compiled, slowly, before the
limits. Concurrent compiles of one schema run once; schemas equal up to whitespace share an
entry; the cache evicts by compiled bytes as well as by count.
"""
from __future__ import annotations

import json
import threading

import pytest

from engine.config import StructuredOutput
from engine.structured import GrammarCache

VOCAB_SIZE = 49152


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _strings(lengths) -> dict:
    properties = {f"p{i}": {"type": "string", "maxLength": n} for i, n in enumerate(lengths)}
    return {"type": "object", "properties": properties, "required": list(properties)}


# Each compiled before, in (on a 2-core box) 0.1 s, 6 s, 5 s, 5 s, 2 s, 5 s, 4 s and 6 s.
HOSTILE = [
    ("json_schema", json.dumps(_nested(64)), "nests more than 32 levels deep"),
    ("json_schema", json.dumps(_strings([100, 101, 102, 103])), "too costly to compile"),
    ("json_schema", json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}),
     "expands to a grammar of"),
    ("regex", "".join("[^x]{0,%d}x" % (100 + i) for i in range(4)), "too costly to compile"),
    ("regex", "(a|b|c|[^x]*)*" * 40, "too costly to compile"),
    ("regex", "[^x]" * 1000, "too costly to compile"),
    ("grammar", "root ::= " + " ".join('[^x]{0,%d} "x"' % (100 + i) for i in range(4)), "too costly to compile"),
    ("json_schema", json.dumps({"type": "string", "pattern": "[^x]" * 1000}), "too costly to compile"),
]


@pytest.fixture(scope="module")
def cache(smollm2_tokenizer) -> GrammarCache:
    return GrammarCache(smollm2_tokenizer, VOCAB_SIZE, smollm2_tokenizer.eos_token_ids)


@pytest.mark.parametrize("kind,spec,message", HOSTILE, ids=lambda v: v[:24] if isinstance(v, str) else None)
def test_costly_constraints_are_refused_before_compiling(cache, kind, spec, message):
    before = cache.num_compiled
    with pytest.raises(ValueError, match=f"invalid {kind}: .*{message}"):
        cache.compile(StructuredOutput(kind, spec))
    assert cache.num_compiled == before


@pytest.mark.parametrize("schema", [
    _nested(12), _strings([100, 100, 64]),
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(200)}},
    {"type": "array", "items": {"enum": [f"value{i}" for i in range(2000)]}, "minItems": 1, "maxItems": 50}])
def test_ordinary_schemas_still_compile(cache, schema):
    assert cache.compile(StructuredOutput("json_schema", json.dumps(schema))).memory_size_bytes > 0


def test_concurrent_compiles_of_one_schema_run_once(smollm2_tokenizer):
    cache = GrammarCache(smollm2_tokenizer, VOCAB_SIZE, smollm2_tokenizer.eos_token_ids)
    cache.compile(StructuredOutput("regex", "warm-up"))   # tokenizer info built outside the race
    constraint = StructuredOutput("regex", "[^x]{0,48}x")   # ~0.5 s to compile: the threads overlap
    num_threads = 6
    start = threading.Barrier(num_threads)
    results: list = [None] * num_threads

    def compile_one(i: int) -> None:
        start.wait(timeout=60)
        results[i] = cache.compile(constraint)

    threads = [threading.Thread(target=compile_one, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert cache.num_compiled == 2                       # the warm-up and one compile of the regex
    assert all(result is results[0] and result is not None for result in results)


def test_concurrent_waiters_share_a_refusal(smollm2_tokenizer):
    cache = GrammarCache(smollm2_tokenizer, VOCAB_SIZE, smollm2_tokenizer.eos_token_ids)
    bad = StructuredOutput("regex", "[^x]{0,40}(unclosed")
    errors: list[str] = []
    start = threading.Barrier(4)

    def compile_one() -> None:
        start.wait(timeout=60)
        try:
            cache.compile(bad)
        except ValueError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=compile_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(errors) == 4 and len(set(errors)) == 1 and errors[0].startswith("invalid regex")
    assert cache.num_compiled == 0


def test_equal_schemas_share_a_cache_entry_whatever_their_whitespace(cache):
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string", "maxLength": 5}},
              "required": ["b", "a"]}
    before = cache.num_compiled
    first = cache.compile(StructuredOutput("json_schema", json.dumps(schema)))
    assert cache.compile(StructuredOutput("json_schema", json.dumps(schema, indent=4))) is first
    assert cache.compile(StructuredOutput("json_schema", json.dumps(schema, ensure_ascii=True,
                                                                    separators=(",", ":")))) is first
    choice = cache.compile(StructuredOutput("choice", '["x",  "y"]'))
    assert cache.compile(StructuredOutput("choice", '["x","y"]')) is choice
    assert cache.num_compiled == before + 2
    # Property order is the order the output follows: a different grammar, another entry.
    reordered = {**schema, "properties": dict(reversed(list(schema["properties"].items())))}
    assert cache.compile(StructuredOutput("json_schema", json.dumps(reordered))) is not first
    assert cache.num_compiled == before + 3


def test_cache_evicts_by_compiled_bytes(smollm2_tokenizer):
    probe = GrammarCache(smollm2_tokenizer, VOCAB_SIZE, smollm2_tokenizer.eos_token_ids)
    regexes = [f"[a-z]{{0,{n}}}x" for n in (20, 21, 22, 23)]
    sizes = [probe.compile(StructuredOutput("regex", r)).memory_size_bytes for r in regexes]
    max_bytes = sizes[0] + sizes[1] + sizes[2] // 2       # room for two of them, not three
    cache = GrammarCache(smollm2_tokenizer, VOCAB_SIZE, smollm2_tokenizer.eos_token_ids, max_bytes=max_bytes)
    for regex in regexes[:3]:
        cache.compile(StructuredOutput("regex", regex))
    assert cache.cached_nbytes == sizes[1] + sizes[2] <= max_bytes
    cache.compile(StructuredOutput("regex", regexes[1]))   # still held: no compile
    assert cache.num_compiled == 3
    cache.compile(StructuredOutput("regex", regexes[0]))   # evicted first: compiled again
    assert cache.num_compiled == 4 and cache.cached_nbytes <= max_bytes
