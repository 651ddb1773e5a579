"""deploy.bench.datasets: synthetic prompts have the lengths asked for; JSONL errors say file:line."""
from __future__ import annotations

import json
import re

import pytest

from deploy.bench.config import WorkloadConfig
from deploy.bench.datasets import LEN_TOLERANCE, PromptMaker, jsonl_requests, load_requests
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model("smollm2-135m-instruct")


def _len(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("input_len", [1, 16, 300])
def test_random_prompts_have_input_len_tokens(tokenizer, input_len):
    reqs = load_requests(WorkloadConfig(dataset="random", num_prompts=20, input_len=input_len, output_len=7), tokenizer)
    assert len(reqs) == 20
    for r in reqs:
        assert r.prompt_len == _len(tokenizer, r.prompt)
        assert abs(r.prompt_len - input_len) <= LEN_TOLERANCE, (r.prompt_len, r.prompt)
        assert r.max_tokens == 7 and r.messages is None
    assert len({r.prompt for r in reqs}) == 20


def test_random_prompts_are_seeded(tokenizer):
    def prompts(seed):
        return [r.prompt for r in load_requests(WorkloadConfig(num_prompts=3, input_len=32, seed=seed), tokenizer)]
    assert prompts(1) == prompts(1)
    assert prompts(1) != prompts(2)


def test_random_prompts_avoid_special_tokens(tokenizer):
    maker = PromptMaker(tokenizer, seed=0)
    text, _ = maker.text(2000)
    ids = set(tokenizer.encode(text, add_special_tokens=False))
    assert not ids & set(tokenizer.backend.get_added_tokens_decoder())
    assert "\ufffd" not in text


def test_shared_prefix_groups_share_their_system_prompt(tokenizer):
    config = WorkloadConfig(dataset="shared-prefix", num_prompts=9, num_groups=3, prefix_len=100, suffix_len=10,
                            output_len=5)
    reqs = load_requests(config, tokenizer)
    assert [r.group for r in reqs] == [0, 1, 2] * 3
    prefixes = [reqs[g].messages[0]["content"] for g in range(3)]
    assert len(set(prefixes)) == 3
    for r in reqs:
        prefix = prefixes[r.group]
        assert r.messages[0] == {"role": "system", "content": prefix}
        assert r.messages[1]["role"] == "user" and r.messages[1]["content"] not in prefixes
        assert r.prompt == prefix + "\n" + r.messages[1]["content"]
        assert abs(_len(tokenizer, prefix) - 100) <= LEN_TOLERANCE
        # the shared tokens really are shared at the token level, not just as text
        assert tokenizer.encode(r.prompt, add_special_tokens=False)[:95] == \
            tokenizer.encode(prefix, add_special_tokens=False)[:95]
        assert r.prompt_len == _len(tokenizer, r.prompt)
        assert 110 - 2 * LEN_TOLERANCE <= r.prompt_len <= 110 + 2 * LEN_TOLERANCE + 1
    assert len({r.messages[1]["content"] for r in reqs}) == 9


def test_mixed_has_the_long_fraction(tokenizer):
    config = WorkloadConfig(dataset="mixed", num_prompts=20, short_len=8, long_len=200, long_fraction=0.25)
    reqs = load_requests(config, tokenizer)
    lens = [r.prompt_len for r in reqs]
    long = [n for n in lens if n > 100]
    assert len(long) == 5
    assert all(abs(n - 200) <= LEN_TOLERANCE for n in long)
    assert all(abs(n - 8) <= LEN_TOLERANCE for n in lens if n <= 100)
    assert [n > 100 for n in lens] != [False] * 15 + [True] * 5   # shuffled, not appended


def test_jsonl_prompts_and_messages(tokenizer, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "Hello world", "max_tokens": 5}) + "\n\n"
                    + json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi"}]}) + "\n"
                    + json.dumps({"prompt": "third"}) + "\n")
    config = WorkloadConfig(dataset="jsonl", dataset_path=str(path), output_len=9)
    reqs = load_requests(config, tokenizer)
    assert [(r.prompt_len, r.max_tokens) for r in reqs] == [
        (_len(tokenizer, "Hello world"), 5), (_len(tokenizer, "Be brief.") + _len(tokenizer, "Hi"), 9),
        (_len(tokenizer, "third"), 9)]
    assert reqs[0].chat_messages() == [{"role": "user", "content": "Hello world"}]
    assert reqs[1].chat_messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    two = load_requests(WorkloadConfig(dataset="jsonl", dataset_path=str(path), num_prompts=2), tokenizer)
    assert len(two) == 2


@pytest.mark.parametrize(("line3", "message"), [
    ('{"prompt": "x"', ":3: invalid JSON: Expecting ',' delimiter"),
    ('{"text": "x"}', ":3: expected an object with exactly one of 'prompt' or 'messages'"),
    ('["x"]', ":3: expected an object with exactly one of 'prompt' or 'messages'"),
    ('{"prompt": "x", "max_tokens": 0}', ":3: 'max_tokens' must be a positive integer, got 0"),
    ('{"prompt": 5}', ":3: 'prompt' must be a string"),
    ('{"messages": [{"role": "user"}]}', ":3: 'messages' must be a non-empty list"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, line3, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n' + line3 + "\n")
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}{message}")):
        jsonl_requests(path, str.split, None, 4)


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read --dataset-path"):
        jsonl_requests(tmp_path / "nope.jsonl", str.split, None, 4)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        jsonl_requests(tmp_path / "empty.jsonl", str.split, None, 4)


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--long-fraction must be in"):
        WorkloadConfig(long_fraction=1.5)
    with pytest.raises(ValueError, match="--input-len must be >= 1"):
        WorkloadConfig(input_len=0)
