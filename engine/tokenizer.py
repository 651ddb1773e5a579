"""Tokenizer, chat template and incremental detokenizer.

Used by the router process (chat templating, prompt encoding, streaming text back to clients)
and by the workers (stop-token ids). Importing this module must not import torch
(docs/architecture.md#packages-and-import-direction): it needs only the stdlib, ``tokenizers`` and ``jinja2``.

Two sources are supported. A Hugging Face model directory carries a ``tokenizer.json`` that
``tokenizers`` loads as is. A GGUF file carries the vocabulary, merges and special ids as
metadata (read by ``engine.gguf_file``, standard library only), from which the same kind of
``tokenizers.Tokenizer`` is rebuilt, the way llama.cpp and transformers read it.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from engine.gguf_file import read_gguf_metadata
from engine.model_source import resolve_model

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
_MAX_INCOMPLETE_TOKENS = 3   # a UTF-8 character has at most 3 bytes still to come, each in some token
_GIL_FREE_ENCODE_CHARS = 4096

# llama.cpp's token types (tokenizer.ggml.token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# ---------------------------------------------------------------------------------------------
# Building a tokenizers.Tokenizer from GGUF metadata

# Split patterns of byte-level BPE vocabularies, keyed by tokenizer.ggml.pre; they match the
# tokenizer.json each model was trained with (and llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # SmolLM / StarCoder: every digit is its own pre-token, then GPT-2's split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre_tokenizer()])


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# pre -> (pre-tokenizer factory, BPE ignore_merges, NFC normalizer)
_BYTE_LEVEL_PRE = {
    "default": (_gpt2_pre_tokenizer, False, False),
    "gpt-2": (_gpt2_pre_tokenizer, False, False),
    "gpt2": (_gpt2_pre_tokenizer, False, False),
    "smollm": (_digits_then_gpt2, False, False),
    "starcoder": (_digits_then_gpt2, False, False),
    "refact": (_digits_then_gpt2, False, False),
    # Llama 3 looks a whole pre-token up in the vocabulary before merging (ignore_merges).
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), True, False),
    "llama3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), True, False),
    # Qwen2's tokenizer.json NFC-normalizes before splitting (llama.cpp skips that step).
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), False, True),
}


def _byte_level_bpe(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _BYTE_LEVEL_PRE:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} for a gpt2 tokenizer; "
                         f"supported: {sorted(_BYTE_LEVEL_PRE)}")
    make_pre_tokenizer, ignore_merges, nfc = _BYTE_LEVEL_PRE[pre]
    tokens = _require(meta, "tokenizer.ggml.tokens")
    merges = _parse_merges(_require(meta, "tokenizer.ggml.merges"))
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    if nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = make_pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: split every piece into two known
    pieces and rank the merge by the merged piece's score (the conversion HF uses)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked: list[tuple[float, str, str]] = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, left, right) for left, right in local)
    # Stable sort: ties keep vocabulary order, as in HF's conversion.
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in ranked]


def _sentencepiece_bpe(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    tokens = _require(meta, "tokenizer.ggml.tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = _parse_merges(meta["tokenizer.ggml.merges"])
    else:
        merges = _sentencepiece_merges(tokens, _require(meta, "tokenizer.ggml.scores"))
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


_GGUF_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _register_gguf_added_tokens(backend: tokenizers.Tokenizer, meta: Mapping[str, Any]) -> None:
    """Control tokens become special added tokens, so chat markers encode whole and are skipped
    on decode; user-defined ones (``<think>``) encode whole but stay visible, as in llama.cpp."""
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or ()
    special, plain = [], []
    for token, token_type in zip(tokens, token_types):
        if token_type == _TOKEN_TYPE_CONTROL and token:
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == _TOKEN_TYPE_USER_DEFINED and token:
            plain.append(AddedToken(token, special=False, normalized=False))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if meta.get("tokenizer.ggml.model") == "llama" and unk_id is not None and unk_id < len(tokens):
        special.append(AddedToken(tokens[unk_id], special=True, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _parse_merges(merges: Iterable[str]) -> list[tuple[str, str]]:
    split = [merge.split(" ", 1) for merge in merges]
    if any(len(pair) != 2 for pair in split):
        raise ValueError("tokenizer.ggml.merges holds an entry that is not 'left right'")
    return [(left, right) for left, right in split]


def _require(meta: Mapping[str, Any], key: str):
    if key not in meta:
        raise ValueError(f"GGUF metadata has no {key}")
    return meta[key]


# ---------------------------------------------------------------------------------------------
# Hugging Face directory helpers


def _read_json(path: Path) -> dict:
    """The JSON object in ``path``, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def _token_content(value: object) -> str | None:
    # tokenizer_config.json writes a token either as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _int_ids(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _hf_chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    # Newer checkpoints keep the template in its own file, which then wins over the config.
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(root / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{root}: chat templates {sorted(map(str, named))} have no 'default'")
        template = named["default"]
    return template


def _register_hf_added_tokens(backend: tokenizers.Tokenizer, config: Mapping[str, Any],
                              source: Path) -> None:
    """Adds tokens from tokenizer_config.json's added_tokens_decoder that tokenizer.json lacks."""
    for id_text, spec in (config.get("added_tokens_decoder") or {}).items():
        content = _token_content(spec)
        if not isinstance(spec, dict) or not content or backend.token_to_id(content) is not None:
            continue
        token = AddedToken(content, special=bool(spec.get("special", False)),
                           normalized=bool(spec.get("normalized", False)),
                           lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                           single_word=bool(spec.get("single_word", False)))
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
        if backend.token_to_id(content) != int(id_text):
            raise ValueError(f"{source}: added token {content!r} is declared as id {id_text} "
                             f"but would get id {backend.token_to_id(content)}")


# ---------------------------------------------------------------------------------------------
# Chat templates


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_chat_template(template: str, source: str) -> jinja2.Template:
    # The same environment transformers renders templates in, so outputs match it exactly.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template of {source} does not parse: {exc}") from exc


# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop ids."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_id: int | None, extra_eos_token_ids: Iterable[int] = (),
                 add_bos_token: bool = False, chat_template: str | None = None,
                 source: str = "<in memory>") -> None:
        self._backend = backend
        self._source = source
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        eos_ids = set(extra_eos_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
        for token_id in eos_ids | ({bos_token_id} if bos_token_id is not None else set()):
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"{source}: special token id {token_id} is outside the "
                                 f"vocabulary of {self.vocab_size} tokens")
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.add_bos_token: bool = bool(add_bos_token and bos_token_id is not None)
        self.chat_template: str | None = chat_template
        self._bos_token = self.id_to_token(bos_token_id) if bos_token_id is not None else None
        self._eos_token = self.id_to_token(eos_token_id) if eos_token_id is not None else None
        self._template = _compile_chat_template(chat_template, source) if chat_template else None
        # Whether the template renders a ``tools`` list; the router describes tools itself otherwise.
        self.template_takes_tools: bool = chat_template is not None and "tools" in (
            jinja2.meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(chat_template)))
        logger.debug("tokenizer from %s: %d tokens, bos=%s, eos=%s, chat template: %s", source,
                     self.vocab_size, bos_token_id, sorted(self.eos_token_ids), chat_template is not None)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Loads tokenizer.json plus the optional tokenizer_config.json, config.json,
        generation_config.json and chat_template.jinja of a Hugging Face model directory."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tokenizer_file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"{tokenizer_file} is not a valid tokenizer.json: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json")
        model_config = _read_json(root / "config.json")
        generation_config = _read_json(root / "generation_config.json")
        _register_hf_added_tokens(backend, config, root / "tokenizer_config.json")

        def token_id(name: str) -> int | None:
            content = _token_content(config.get(name))
            if content is None:
                return None
            found = backend.token_to_id(content)
            if found is None:
                raise ValueError(f"{root}: {name} {content!r} is not in the vocabulary")
            return found

        bos_id = token_id("bos_token")
        if bos_id is None:
            bos_id = next(iter(_int_ids(model_config.get("bos_token_id"))), None)
        config_eos = (_int_ids(model_config.get("eos_token_id"))
                      + _int_ids(generation_config.get("eos_token_id")))
        eos_id = token_id("eos_token")
        if eos_id is None:
            eos_id = next(iter(config_eos), None)
        add_bos = config.get("add_bos_token")
        if add_bos is None and bos_id is not None:
            # No flag: follow whatever tokenizer.json's post-processor does.
            add_bos = backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id, extra_eos_token_ids=config_eos,
                   add_bos_token=bool(add_bos), chat_template=_hf_chat_template(root, config),
                   source=str(root))

    @classmethod
    def from_model(cls, model: str) -> Tokenizer:
        """The tokenizer of a built-in model name, an HF directory or a .gguf file."""
        source = resolve_model(model)
        return cls.from_gguf(source.path) if source.kind == "gguf" else cls.from_hf_dir(source.path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Rebuilds the tokenizer described by a GGUF file's ``tokenizer.*`` metadata."""
        meta = read_gguf_metadata(path)
        model = meta.get("tokenizer.ggml.model")
        if model not in _GGUF_BUILDERS:
            raise ValueError(f"{path}: unsupported tokenizer.ggml.model {model!r}; "
                             f"supported: {sorted(_GGUF_BUILDERS)}")
        try:
            backend = _GGUF_BUILDERS[model](meta)
            _register_gguf_added_tokens(backend, meta)
        except Exception as exc:  # tokenizers reports bad vocabularies as a bare Exception
            raise ValueError(f"{path}: cannot build its tokenizer: {exc}") from exc
        # llama.cpp ends generation on end-of-turn / end-of-message tokens as well as on EOS.
        extra_eos = [meta[key] for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                     if key in meta]
        # Without the flag, SentencePiece vocabularies add BOS and byte-level ones do not.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", model == "llama")
        return cls(backend, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_token_id=meta.get("tokenizer.ggml.eos_token_id"), extra_eos_token_ids=extra_eos,
                   add_bos_token=add_bos, chat_template=meta.get("tokenizer.chat_template"),
                   source=str(path))

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (e.g. to save it as tokenizer.json)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS is prepended only when the model asks for it."""
        if len(text) > _GIL_FREE_ENCODE_CHARS:
            # tokenizers' encode holds the GIL throughout (seconds for megabytes of text), its
            # encode_batch releases it: the router tokenizes large prompts on a thread while its
            # event loop keeps serving.
            ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            assert self.bos_token_id is not None   # add_bos_token implies it
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               keep_token_ids: frozenset[int] = frozenset()) -> str:
        """``keep_token_ids``: special tokens written out even when the others are skipped (a
        tool-call format's control tokens, such as Mistral's ``[TOOL_CALLS]``)."""
        ids = list(ids)
        if skip_special_tokens and keep_token_ids and not keep_token_ids.isdisjoint(ids):
            special = self.special_token_ids
            return self._backend.decode([i for i in ids if i in keep_token_ids or i not in special],
                                        skip_special_tokens=False)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids a decode that skips special tokens leaves out."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Renders ``messages`` ([{"role": ..., "content": ...}, ...]) with the model's template.
        ``tools`` (OpenAI's [{"type": "function", "function": {...}}]) reaches the template as
        transformers passes it: a ``tools`` variable, None when there are none."""
        if self._template is None:
            raise ValueError(f"{self._source} has no chat template; send a plain prompt instead")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools or None, bos_token=self._bos_token or "",
                                     eos_token=self._eos_token or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered chat; BOS is not doubled when the template writes it."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        bos = self._bos_token or ""
        template_has_bos = bool(bos) and text.startswith(bos)
        return self.encode(text, add_special_tokens=not template_has_bos)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never end inside a UTF-8 character.

    Keeps a window of ids: the last chunk already emitted (the prefix, ids[:read_offset]) and
    the ids not yet emitted. Each call decodes the window with and without the pending ids and
    emits the difference, so decoder rules that depend on neighbours (SentencePiece dropping the
    leading space of a text) see the same context as in a full decode, at O(window) cost. A
    window whose text ends in U+FFFD stops mid-character and is held until completed, but for at
    most ``MAX_HELD_TOKENS`` pending ids: output that never completes a character (a model
    emitting byte tokens that form no UTF-8) would otherwise grow the window, and the cost of
    each call with it. Past that, the held text is emitted up to a cut that decodes the same on
    both sides (a character boundary), keeping the last ``_MAX_INCOMPLETE_TOKENS`` ids, the most
    a still-incomplete character can span: it has at most 3 of its 4 bytes, one or more a token.
    """

    MAX_HELD_TOKENS = 16

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 keep_token_ids: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._keep_token_ids = keep_token_ids   # special tokens written out all the same (Tokenizer.decode)
        self._ids: list[int] = []
        self._read_offset = 0  # ids[:read_offset] are already emitted

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends ``token_ids`` and returns the text they complete (possibly "")."""
        text = ""
        for start in range(0, len(token_ids), self.MAX_HELD_TOKENS):  # a long chunk: window stays bounded
            self._ids.extend(token_ids[start:start + self.MAX_HELD_TOKENS])
            text += self._advance(final=False)
        return text

    def finish(self) -> str:
        """Returns whatever text is still held back, even if it ends mid-character."""
        return self._advance(final=True)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._keep_token_ids:
            return self._tokenizer.decode(ids, self._skip_special_tokens, self._keep_token_ids)
        return self._tokenizer.decode(ids, self._skip_special_tokens)

    def _advance(self, final: bool) -> str:
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text = self._decode(self._ids[:self._read_offset])
        new_text = self._decode(self._ids)
        cut = len(self._ids)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)):
            if len(self._ids) - self._read_offset <= self.MAX_HELD_TOKENS:
                return ""
            cut = self._boundary(new_text)
            new_text = self._decode(self._ids[:cut])
        # The ids just emitted become the next prefix; older ones are no longer needed.
        del self._ids[:self._read_offset]
        self._read_offset = cut - self._read_offset
        return new_text[len(prefix_text):]

    def _boundary(self, text: str) -> int:
        """Where to cut a held window that decodes to ``text``: the last index at most
        ``_MAX_INCOMPLETE_TOKENS`` from the end whose two sides decode to ``text`` together (so
        no character straddles it), or that index itself when none does."""
        last = len(self._ids) - _MAX_INCOMPLETE_TOKENS
        for cut in range(last, self._read_offset, -1):
            head = self._decode(self._ids[:cut])
            if text.startswith(head) and head + self._decode(self._ids[cut:]) == text:
                return cut
        return last
