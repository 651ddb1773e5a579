"""Workloads for `tandem bench`: the prompts to send and how many tokens to ask for.

Runs in the `tandem bench` process, before any request leaves. Synthetic prompts are random
token ids decoded to text with the served model's tokenizer, then re-encoded and trimmed or
topped up until the text really is ``len`` tokens (within ``LEN_TOLERANCE``), as vLLM's random
dataset does. Only ids that decode to clean text on their own are drawn (no special tokens, no
stray UTF-8 bytes), so the text round-trips.

- random: ``input_len`` prompt tokens, ``output_len`` output tokens each.
- shared-prefix: ``num_groups`` random system prompts of ``prefix_len`` tokens; request i
  belongs to group i % num_groups and adds its own ``suffix_len``-token question, so a prefix
  cache sees interleaved groups. Chat backends send the prefix as the system message.
- mixed: round(long_fraction * num_prompts) prompts of ``long_len`` tokens at seeded random
  positions, the rest ``short_len``.
- jsonl: one object per line, ``{"prompt": str}`` or ``{"messages": [{"role", "content"}]}``,
  optional ``"max_tokens"`` (default ``output_len``). A chat prompt's length is the sum of its
  contents' tokens (no template), as vLLM counts it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deploy.bench.config import WorkloadConfig

LEN_TOLERANCE = 2
DEFAULT_NUM_PROMPTS = 100
_MAX_ROUNDS = 10


@dataclass(frozen=True)
class BenchRequest:
    prompt: str                                  # the whole prompt as one text (completions API)
    prompt_len: int
    max_tokens: int
    messages: tuple[dict, ...] | None = None     # chat form, when the workload has one
    group: int | None = None                     # shared-prefix group

    def chat_messages(self) -> list[dict]:
        return list(self.messages) if self.messages is not None else [{"role": "user", "content": self.prompt}]


class PromptMaker:
    """Random text of an exact token length, from a seeded generator."""

    def __init__(self, tokenizer, seed: int) -> None:
        self._tok = tokenizer
        self._rng = np.random.default_rng(seed)
        vocab = tokenizer.vocab_size
        special = set(tokenizer.backend.get_added_tokens_decoder())
        texts = tokenizer.backend.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
        self._ids = np.array([i for i, t in enumerate(texts)
                              if i not in special and t.strip() and "\ufffd" not in t], dtype=np.int64)
        if len(self._ids) == 0:
            raise ValueError("the tokenizer has no plain-text tokens to build random prompts from")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def text(self, num_tokens: int) -> tuple[str, int]:
        """(text, its token count) with |count - num_tokens| <= LEN_TOLERANCE when achievable."""
        ids = self._rng.choice(self._ids, num_tokens).tolist()
        for _ in range(_MAX_ROUNDS):
            text = self._tok.decode(ids)
            got = self.encode(text)
            if abs(len(got) - num_tokens) <= LEN_TOLERANCE:
                return text, len(got)
            # Merges across the joins make re-encoded text longer or shorter: trim or top up.
            ids = got[:num_tokens] if len(got) > num_tokens else got + self._rng.choice(
                self._ids, num_tokens - len(got)).tolist()
        return text, len(got)


def random_requests(maker: PromptMaker, num_prompts: int, input_len: int, output_len: int) -> list[BenchRequest]:
    out = []
    for _ in range(num_prompts):
        text, num_tokens = maker.text(input_len)
        out.append(BenchRequest(text, num_tokens, output_len))
    return out


def shared_prefix_requests(maker: PromptMaker, num_prompts: int, num_groups: int, prefix_len: int,
                           suffix_len: int, output_len: int) -> list[BenchRequest]:
    prefixes = [maker.text(prefix_len)[0] for _ in range(num_groups)]
    out = []
    for i in range(num_prompts):
        group = i % num_groups
        suffix = maker.text(suffix_len)[0]
        prompt = prefixes[group] + "\n" + suffix
        messages = ({"role": "system", "content": prefixes[group]}, {"role": "user", "content": suffix})
        out.append(BenchRequest(prompt, len(maker.encode(prompt)), output_len, messages, group))
    return out


def mixed_requests(maker: PromptMaker, num_prompts: int, short_len: int, long_len: int, long_fraction: float,
                   output_len: int, seed: int) -> list[BenchRequest]:
    num_long = round(long_fraction * num_prompts)
    is_long = np.zeros(num_prompts, dtype=bool)
    is_long[np.random.default_rng(seed).permutation(num_prompts)[:num_long]] = True
    out = []
    for long in is_long:
        text, num_tokens = maker.text(long_len if long else short_len)
        out.append(BenchRequest(text, num_tokens, output_len))
    return out


def _jsonl_request(obj: object, where: str, encode, default_max_tokens: int) -> BenchRequest:
    if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f"{where}: expected an object with exactly one of 'prompt' or 'messages'")
    max_tokens = obj.get("max_tokens", default_max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        return BenchRequest(obj["prompt"], len(encode(obj["prompt"])), max_tokens)
    messages = obj["messages"]
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}")
    messages = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    prompt = "\n".join(m["content"] for m in messages)
    return BenchRequest(prompt, sum(len(encode(m["content"])) for m in messages), max_tokens, messages)


def jsonl_requests(path: str | Path, encode, num_prompts: int | None, default_max_tokens: int) -> list[BenchRequest]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --dataset-path {path}: {exc}") from exc
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        out.append(_jsonl_request(obj, f"{path}:{lineno}", encode, default_max_tokens))
        if num_prompts is not None and len(out) == num_prompts:
            break
    if not out:
        raise ValueError(f"{path}: no prompts (one JSON object per line)")
    return out


def load_requests(config: WorkloadConfig, tokenizer) -> list[BenchRequest]:
    """The workload ``config`` describes, tokenized with ``tokenizer`` (an engine.tokenizer.Tokenizer)."""
    if config.dataset == "jsonl":
        assert config.dataset_path is not None   # WorkloadConfig requires it for jsonl
        return jsonl_requests(config.dataset_path, lambda t: tokenizer.encode(t, add_special_tokens=False),
                              config.num_prompts, config.output_len)
    n = config.num_prompts or DEFAULT_NUM_PROMPTS
    maker = PromptMaker(tokenizer, config.seed)
    if config.dataset == "random":
        return random_requests(maker, n, config.input_len, config.output_len)
    if config.dataset == "shared-prefix":
        return shared_prefix_requests(maker, n, config.num_groups, config.prefix_len, config.suffix_len,
                                      config.output_len)
    return mixed_requests(maker, n, config.short_len, config.long_len, config.long_fraction,
                          config.output_len, config.seed)
