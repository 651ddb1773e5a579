"""Structured output in the in-process engine with SmolLM2: every output that ends with "stop"
parses and validates against its schema (or matches its regex / choice), greedy and sampled,
over several prompts and seeds; an unsatisfiable length ends with "length"; a bad schema is a
ValueError before anything runs; the grammar cache compiles each schema once; the decode side
resumes a matcher from the tokens so far (engine.add_prefilled, as a decode worker does)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.config import SamplingParams, StructuredOutput
from engine.llm import LLM
from engine.sampler import Sampler, SamplingRequest
from engine.structured import GrammarCache

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Oslo", "Lima"]}},
          "required": ["name", "age", "city"]}
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {
    "type": "string", "maxLength": 8}, "maxItems": 2}}, "required": ["ok", "tags"]}
PROMPTS = ["Describe a person as JSON.", "Who lives in Oslo?", "Tell me about a doctor.", "Any answer in JSON"]


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    engine = LLM(str(smollm2_gguf), dtype="float32", device="cpu", max_model_len=512, num_gpu_blocks_override=128)
    yield engine
    engine.close()


def _chats(prompts):
    return [[{"role": "user", "content": p}] for p in prompts]


def _params(constraint: StructuredOutput, temperature: float, seed: int | None = None, max_tokens: int = 48,
            num_resumed_tokens: int = 0):
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured=constraint,
                          num_resumed_tokens=num_resumed_tokens)


@pytest.mark.parametrize("schema", [PERSON, FLAGS], ids=["person", "flags"])
def test_json_schema_outputs_validate_greedy_and_sampled(llm, schema):
    constraint = StructuredOutput("json_schema", json.dumps(schema))
    params = [_params(constraint, 0.0)] * 2 + [_params(constraint, 1.0, seed) for seed in (1, 2)]
    outs = llm.chat(_chats(PROMPTS), params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
        assert out.token_ids[-1] in llm.engine.eos_token_ids   # the matcher ended on its stop token


def test_json_object_regex_and_choice(llm):
    obj = llm.chat(_chats(PROMPTS[:2]), _params(StructuredOutput("json_object"), 1.0, 7, max_tokens=120))
    for out in obj:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 120
    pattern = r"[0-9]{3}-[a-z]{2,6}"
    for out in llm.chat(_chats(PROMPTS), _params(StructuredOutput("regex", pattern), 1.0, 3)):
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text
    choices = ["yes", "no", "it depends"]
    for out in llm.chat(_chats(PROMPTS), [_params(StructuredOutput("choice", json.dumps(choices)), t, s)
                                          for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (1.0, 3))]):
        assert out.finish_reason == "stop" and out.text in choices


def test_too_few_tokens_end_with_length_never_stop(llm):
    constraint = StructuredOutput("json_schema", json.dumps(PERSON))
    for out in llm.chat(_chats(PROMPTS), [_params(constraint, t, 5, max_tokens=6) for t in (0.0, 1.0, 0.0, 1.0)]):
        assert out.finish_reason == "length" and len(out.token_ids) == 6
        with pytest.raises(json.JSONDecodeError, match=r"line \d+ column \d+"):
            json.loads(out.text)


def test_ignore_eos_still_stops_when_the_grammar_ends(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                            structured=StructuredOutput("choice", json.dumps(["red", "blue"])))
    out = llm.chat(_chats(["Pick a color"]), params)[0]
    assert out.finish_reason == "stop" and out.text in ("red", "blue")


@pytest.mark.parametrize("kind,spec", [("json_schema", '{"type": "nonsense"}'), ("json_schema", '{"$ref": "#/nope"}'),
                                       ("regex", "(unclosed"), ("grammar", "root ::= missing_rule")])
def test_a_constraint_that_does_not_compile_is_refused_before_running(llm, kind, spec):
    with pytest.raises(ValueError, match=f"invalid {kind}"):
        llm.engine.add_request("bad", [1, 2, 3], _params(StructuredOutput(kind, spec), 0.0))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kind,spec,message", [
    ("json_schema", "{not json", "the JSON schema is not valid JSON"),
    ("json_schema", "[1]", "a JSON schema is an object or a boolean, not list"),
    ("choice", "[]", "choice must be a non-empty list"), ("choice", '["a", 3]', "choice must be a non-empty list"),
    ("regex", "", "the regex is empty"), ("json_object", "{}", "json_object takes no schema"),
    ("xml", "x", "structured output kind 'xml' is not supported")])
def test_structured_output_checks_without_a_grammar_engine(kind, spec, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(kind, spec)


def test_grammar_cache_compiles_each_schema_once_and_evicts_lru(smollm2_tokenizer):
    cache = GrammarCache(smollm2_tokenizer, 49152, smollm2_tokenizer.eos_token_ids, max_entries=2)
    a, b, c = (StructuredOutput("regex", r) for r in ("a+", "b+", "c+"))
    first = cache.compile(a)
    assert cache.compile(StructuredOutput("regex", "a+")) is first   # same grammar
    assert cache.num_compiled == 1
    cache.compile(b)
    cache.compile(a)          # a is now the most recent; b goes when c arrives
    cache.compile(c)
    assert cache.num_compiled == 3
    cache.compile(a)
    assert cache.num_compiled == 3
    cache.compile(b)
    assert cache.num_compiled == 4


def test_matcher_resumes_from_the_tokens_so_far(smollm2_tokenizer):
    cache = GrammarCache(smollm2_tokenizer, 49152, smollm2_tokenizer.eos_token_ids)
    constraint = StructuredOutput("choice", json.dumps(["hello world"]))
    tokens = smollm2_tokenizer.encode("hello world", add_special_tokens=False)
    state = cache.matcher(constraint, tokens)
    assert not state.is_terminated
    assert state.accept(2) and state.is_terminated      # SmolLM2's eos, allowed once complete
    with pytest.raises(ValueError, match="cannot be resumed"):
        cache.matcher(constraint, smollm2_tokenizer.encode("goodbye", add_special_tokens=False))


def test_sampler_masks_only_constrained_rows(smollm2_tokenizer):
    cache = GrammarCache(smollm2_tokenizer, 49152, smollm2_tokenizer.eos_token_ids)
    yes = smollm2_tokenizer.encode("yes", add_special_tokens=False)
    assert len(yes) == 1
    state = cache.matcher(StructuredOutput("choice", '["yes"]'))
    logits = torch.zeros(2, 49152)
    logits[:, 100] = 10.0            # the unconstrained favourite
    logits[:, yes[0]] = 5.0          # above "y", "ye" and every other token the grammar allows
    greedy = SamplingParams(temperature=0.0)
    out = Sampler()(logits, [SamplingRequest(greedy, [1], [], grammar=state), SamplingRequest(greedy, [1], [])])
    assert out.token_ids == [yes[0], 100]
    assert logits[0, 100] == 10.0    # the runner's logits are left as they were


def test_decode_side_resumes_after_the_prefill_token(llm):
    """add_prefilled with a grammar: the first token (sampled by a prefill worker) and a failover's
    resumed tokens are accepted before decoding, and decoding finishes the JSON."""
    engine = llm.engine
    schema = json.dumps(PERSON)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "A person, please"}])
    ref = llm.generate([prompt], _params(StructuredOutput("json_schema", schema), 0.0))[0]
    assert ref.finish_reason == "stop"
    # A retry's prompt carries the 3 tokens already streamed; the prefill worker sampled the 4th.
    resumed = prompt + ref.token_ids[:3]
    params = _params(StructuredOutput("json_schema", schema), 0.0, max_tokens=len(ref.token_ids) - 3,
                     num_resumed_tokens=3)
    prefill = llm.generate([resumed], SamplingParams(temperature=0.0, max_tokens=1, structured=params.structured,
                                                     num_resumed_tokens=3))[0]
    assert prefill.token_ids == ref.token_ids[3:4]
    with pytest.raises(ValueError, match="cannot be resumed"):
        engine.add_prefilled("bad-first", resumed, params, [], first_token=engine.tokenizer.encode("x")[-1])
    assert "bad-first" not in engine.sequences
    # The rest, resumed after 4 tokens, continues the reference exactly and ends it with "stop".
    out = llm.generate([resumed + prefill.token_ids], _params(
        StructuredOutput("json_schema", schema), 0.0, max_tokens=len(ref.token_ids) - 4, num_resumed_tokens=4))[0]
    assert ref.token_ids[:4] + out.token_ids == ref.token_ids and out.finish_reason == "stop"


def test_structured_params_round_trip_through_the_worker_proto():
    from worker.convert import sampling_from_proto, sampling_to_proto

    params = SamplingParams(temperature=0.5, max_tokens=9, num_resumed_tokens=2,
                            structured=StructuredOutput("choice", '["a", "b"]'))
    msg = sampling_to_proto(params)
    assert (msg.grammar.kind, msg.grammar.spec, msg.num_resumed_tokens) == ("choice", '["a", "b"]', 2)
    assert sampling_from_proto(msg) == params
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).structured is None
