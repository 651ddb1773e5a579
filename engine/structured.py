"""Structured output: grammars compiled with xgrammar, one matcher per constrained request.

Runs in every worker process: the prefill worker samples a constrained request's first token,
the decode worker every later one, so both compile the same grammar (``GrammarCache``) and the
decode side starts its matcher from the tokens generated so far (``GrammarCache.matcher``: a
failover's re-sent output, then the prefill worker's first token). The sampler masks the logits
of constrained rows with ``apply_grammar_masks``; the engine feeds every sampled token back
with ``GrammarState.accept`` and finishes the request with ``stop`` once the matcher terminated
(it accepts an end-of-sequence token only where the grammar is complete, so a request cut short
by max_tokens ends with ``length``).

xgrammar (and the transformers it wraps the tokenizer with) is imported on the first
constrained request, not at engine start: a worker that never sees one pays nothing.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from engine.config import StructuredOutput
from engine.grammar_limits import check_grammar_cost, check_schema_shape, embedded_regexes

if TYPE_CHECKING:
    import torch

    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DEFAULT_CACHE_ENTRIES = 128
DEFAULT_CACHE_BYTES = 256 << 20   # compiled grammars' own estimate (CompiledGrammar.memory_size_bytes)


def _xgrammar():
    import xgrammar  # 3 s and transformers on first import: only once a request needs it

    return xgrammar


def _canonical_spec(constraint: StructuredOutput) -> str:
    """The spec as a cache key: JSON re-serialized compactly (key order kept: it is the order the
    output's properties follow), so equal schemas sent with other whitespace or escapes hit."""
    if constraint.kind in ("json_schema", "choice"):
        parsed = json.loads(constraint.spec)
        check_schema_shape(parsed)   # before anything recurses through it
        return json.dumps(parsed, ensure_ascii=False, separators=(",", ":"))
    return constraint.spec


def _grammar(kind: str, spec: str) -> Any:
    """The constraint as an xgrammar.Grammar, not compiled yet (its EBNF is what the cost is
    estimated from)."""
    grammar = _xgrammar().Grammar
    if kind == "json_schema":
        # No free whitespace: a small model otherwise pads with newlines until max_tokens.
        return grammar.from_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        return grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return grammar.from_regex(spec)
    if kind == "choice":
        return grammar.from_ebnf(_choice_grammar(spec))
    return grammar.from_ebnf(spec)


def _choice_grammar(spec: str) -> str:
    """EBNF whose root is exactly one of the choices (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in json.loads(spec))


class GrammarState:
    """One request's matcher: what its next token may be, and the tokens it has accepted."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it here."""
        return bool(self._matcher.accept_token(int(token_id)))

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (an int32 CPU bitmask)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end-of-sequence token was accepted."""
        return bool(self._matcher.is_terminated())


class GrammarCache:
    """Compiles constraints for one tokenizer, keeping the most recently used compiled grammars up
    to ``max_entries`` of them and ``max_bytes`` of compiled size (LRU keyed by kind + canonical
    spec, so schemas that differ only in whitespace or escapes share an entry; the cache belongs
    to this tokenizer and vocabulary size).

    Thread-safe: the workers' servicers compile off the engine thread (so a new schema is
    checked, and refused with a clear error, before the request is queued) and the engine thread
    then finds it here. Concurrent compiles of one key are single-flight: the first caller
    compiles, the others wait for its grammar (or its error). A constraint whose estimated
    compile cost exceeds engine.grammar_limits' budget is refused before compiling.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 max_entries: int = DEFAULT_CACHE_ENTRIES, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(set(stop_token_ids))
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._nbytes: dict[tuple[str, str], int] = {}
        self._in_flight: dict[tuple[str, str], Future] = {}
        self.num_compiled = 0    # compilations done (cache misses)
        self.cached_nbytes = 0   # compiled size of the grammars held

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                xgr = _xgrammar()
                from transformers import PreTrainedTokenizerFast

                # xgrammar reads the vocabulary and its byte encoding from a transformers tokenizer.
                wrapped = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(wrapped, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar (xgrammar.CompiledGrammar); ValueError naming the problem when
        the schema, regex, choice or grammar cannot be compiled or would cost too much to."""
        try:
            key = (constraint.kind, _canonical_spec(constraint))
        except ValueError as exc:
            raise ValueError(f"invalid {constraint.kind}: {exc}") from None
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
            waiting = self._in_flight.get(key)
            if waiting is None:
                pending: Future = Future()
                self._in_flight[key] = pending
        if waiting is not None:
            return waiting.result()   # the same grammar, compiled (or refused) by the first caller
        try:
            compiled = self._compile_new(constraint.kind, key[1])
        except BaseException as exc:
            with self._lock:
                del self._in_flight[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._in_flight[key]
            self._store(key, compiled)
        pending.set_result(compiled)
        return compiled

    def _store(self, key: tuple[str, str], compiled: Any) -> None:
        """Under ``self._lock``: add ``compiled``, then evict the least recently used grammars
        until both bounds hold (the newest stays even when it alone exceeds ``max_bytes``)."""
        self.num_compiled += 1
        nbytes = int(compiled.memory_size_bytes)
        self._compiled[key] = compiled
        self._nbytes[key] = nbytes
        self.cached_nbytes += nbytes
        while len(self._compiled) > 1 and (len(self._compiled) > self._max_entries
                                           or self.cached_nbytes > self._max_bytes):
            old, _ = self._compiled.popitem(last=False)
            self.cached_nbytes -= self._nbytes.pop(old)

    def _compile_new(self, kind: str, spec: str) -> Any:
        compiler = self._get_compiler()
        try:
            grammar = _grammar(kind, spec)
            ebnf = str(grammar)
            check_grammar_cost(kind, ebnf + "".join(f"\n{_xgrammar().Grammar.from_regex(pattern)}"
                                                    for pattern in embedded_regexes(ebnf)))
            return compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:   # xgrammar raises RuntimeError from C++
            raise ValueError(f"invalid {kind}: {_first_line(exc)}") from None

    def matcher(self, constraint: StructuredOutput, generated_token_ids: Sequence[int] = ()) -> GrammarState:
        """A matcher that has accepted ``generated_token_ids`` (what earlier attempts or the
        prefill worker sampled under this constraint); ValueError if the grammar refuses one."""
        state = GrammarState(_xgrammar().GrammarMatcher(self.compile(constraint)))
        for i, token_id in enumerate(generated_token_ids):
            if not state.accept(token_id):
                raise ValueError(f"token {token_id} (generated token {i}) does not follow the request's "
                                 f"{constraint.kind}: the tokens so far cannot be resumed")
        return state


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set to -inf, in place, every logit of ``rows`` that their grammar forbids next. The mask is
    filled on the CPU (xgrammar's matchers write host memory) and applied where the logits are:
    xgrammar's CPU kernel, or its CUDA one after one host-to-device copy of the bitmask."""
    xgr = _xgrammar()
    vocab_size = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab_size)
    for row, state in zip(rows, states):
        state.fill_mask(bitmask, row)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    # xgrammar prefixes its C++ messages with "[time] /path/file.cc:line: ".
    if line.startswith("[") and ".cc:" in line:
        line = line.split(": ", 1)[-1]
    return line[:300]
