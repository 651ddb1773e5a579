"""What a structured-output constraint may cost to compile (every worker process).

xgrammar's compile time and memory are not bounded by the size of the request: it precomputes,
for every position of the grammar, which of the vocabulary's tokens may come next, so its cost
grows with the number of character classes, with every step of a bounded repetition (a string's
``maxLength``, a regex's ``{0,100}``: up to ~256 steps each before it switches to a cheaper
scheme) and with recursive rules (a ``*`` inside a ``*``). Its JSON-schema converter is itself
superlinear in nesting depth (400 nested objects: 20 s). Measured on a 2-core CPU box with
SmolLM2's 49k vocabulary: ``[^x]`` x 4000 took 5 s, 16 strings of distinct ``maxLength`` 27 s,
``(a|b|c|[^x]*)*`` x 200 12 s, 3000 optional properties over a minute.

``check_schema_shape`` runs on the parsed schema before conversion; ``check_grammar_cost`` on
the converted grammar's EBNF (xgrammar's own printout, with each embedded ``Regex("...")``
converted and appended) before the compile. Both raise
ValueError (INVALID_ARGUMENT at the worker, a 400 at the router). The cost is an estimate in
"units" calibrated against the shapes above (one unit is roughly 5 ms of compile and 2 KB of
compiled grammar there): what the budget admits compiled within about 3 s on that box.
"""
from __future__ import annotations

import json
import re
from typing import Any

MAX_SCHEMA_DEPTH = 32           # nested JSON containers in a schema (the converter is ~cubic in depth)
MAX_GRAMMAR_EBNF_CHARS = 65536  # the converted grammar, as xgrammar prints it
MAX_GRAMMAR_COST = 640          # estimated compile units (see module docstring)

_REPETITION_STEP_COST = 2       # each step of ``x{m, n}``, up to _REPETITION_STEPS_CAP steps
_REPETITION_STEPS_CAP = 256     # xgrammar expands bounded repetitions up to about this many steps
_RECURSIVE_RULE_COST = 16       # a rule that refers to itself (``*`` inside ``*``: ~60 ms each)
_RULE = re.compile(r"^(\w+) ::= (.*)$", re.MULTILINE)
_REPETITION = re.compile(r"\{(\d+), (-?\d+)\}")
_CHAR_CLASS = re.compile(r"\[(?:\\.|[^\]\\])*\]")
_EMBEDDED_REGEX = re.compile(r'Regex\("((?:\\.|[^"\\])*)"')
# The grammar every JSON constraint carries (basic_string, basic_any, ...): its recursion is
# compiled in every json_schema/json_object grammar and is cheap.
_BUILTIN_RULE_PREFIX = "basic_"


def check_schema_shape(schema: Any) -> None:
    """ValueError when the parsed JSON schema nests deeper than MAX_SCHEMA_DEPTH containers."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def embedded_regexes(ebnf: str) -> list[str]:
    """The patterns of ``Regex("...")`` elements (a JSON schema's ``pattern``): xgrammar prints them
    unexpanded but compiles them like a regex constraint, so their cost is counted as one."""
    patterns = []
    for literal in _EMBEDDED_REGEX.findall(ebnf):
        try:
            patterns.append(json.loads(f'"{literal}"'))
        except ValueError:
            patterns.append(literal)
    return patterns


def grammar_cost(ebnf: str) -> int:
    """Estimated compile units of a grammar printed by xgrammar (``str(Grammar)``)."""
    cost = len(_CHAR_CLASS.findall(ebnf))
    for low, high in _REPETITION.findall(ebnf):
        steps = int(low) if int(high) < 0 else max(int(low), int(high))
        cost += _REPETITION_STEP_COST * min(steps, _REPETITION_STEPS_CAP)
    for name, body in _RULE.findall(ebnf):
        if not name.startswith(_BUILTIN_RULE_PREFIX) and re.search(rf"\b{name}\b", body):
            cost += _RECURSIVE_RULE_COST
    return cost


def check_grammar_cost(kind: str, ebnf: str) -> None:
    """ValueError when compiling this grammar could take more than the budget allows."""
    if len(ebnf) > MAX_GRAMMAR_EBNF_CHARS:
        raise ValueError(f"the {kind} expands to a grammar of {len(ebnf)} characters, more than "
                         f"{MAX_GRAMMAR_EBNF_CHARS}: use fewer properties, alternatives or literals")
    cost = grammar_cost(ebnf)
    if cost > MAX_GRAMMAR_COST:
        raise ValueError(f"the {kind} is too costly to compile (estimated {cost} units, at most "
                         f"{MAX_GRAMMAR_COST}): use fewer or shorter length bounds, repetitions "
                         f"and character classes")
