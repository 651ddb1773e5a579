"""One fact, one place: each shared limit or name list has one definition that the others import.

Where the import direction (tests/test_architecture.py) keeps two packages from importing each
other -- engine and kvtransfer, kvtransfer and protos -- or importing the owner would load torch
into a process that has none (kvtransfer's backend names in worker/config.py, which `tandem serve`
and the controller import), the second copy is checked equal here.
"""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import kvtransfer
from engine.config import DEFAULT_MAX_TOKENS, CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvtransfer.descriptor import TRANSPORTS
from kvtransfer.messages import MAX_REQUEST_ID_LEN
from protos.limits import MAX_CLIENT_REQUEST_ID_CHARS, MAX_REQUEST_ID_CHARS
from worker.config import KV_BACKENDS, NOT_FLAGS, PROCESS_KV_BACKENDS, WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "kvtransfer", "worker", "router", "prefill_worker", "decode_worker", "protos", "deploy",
           "tandem_client", "tandem_shm")
# name -> the one module that defines it
DEFINED_IN = {
    "ROLES": "protos/limits.py",
    "MAX_MESSAGE_BYTES": "protos/limits.py",
    "MAX_REQUEST_ID_CHARS": "protos/limits.py",
    "MAX_CLIENT_REQUEST_ID_CHARS": "protos/limits.py",
    "DEFAULT_CPU_KV_CACHE_BYTES": "engine/config.py",
    "MAX_LOGPROBS": "engine/config.py",
    "DEFAULT_MAX_TOKENS": "engine/config.py",
    "BACKENDS": "kvtransfer/__init__.py",
    "TRANSPORTS": "kvtransfer/descriptor.py",
    "KV_BACKENDS": "worker/config.py",
    "MAX_REQUEST_ID_LEN": "kvtransfer/messages.py",
    "SHM_DIR": "tandem_shm/pools.py",
    "POOL_PREFIX": "tandem_shm/pools.py",
    "POOL_NAME": "tandem_shm/pools.py",
}
# The same name for another fact: tandem bench's client backends (openai, grpc).
OTHER_FACTS = {("BACKENDS", "deploy/bench/config.py")}


def test_each_shared_name_is_assigned_in_one_module():
    pattern = re.compile(r"^(" + "|".join(DEFINED_IN) + r")\s*(:[^=]*)?=", re.MULTILINE)
    found: dict[str, list[str]] = {name: [] for name in DEFINED_IN}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            where = path.relative_to(ROOT).as_posix()
            for match in pattern.finditer(path.read_text(encoding="utf-8")):
                if (match.group(1), where) not in OTHER_FACTS:
                    found[match.group(1)].append(where)
    assert found == {name: [where] for name, where in DEFINED_IN.items()}


def _int_defaults(tree: ast.AST, name_suffix: str) -> list[tuple[int, int]]:
    """(line, value) of every int literal given as a default, field value, assignment or keyword
    argument to a name ending in ``name_suffix``."""
    found = []
    for node in ast.walk(tree):
        pairs: list[tuple[str | None, ast.expr | None]] = []
        if isinstance(node, ast.arguments):
            positional = node.posonlyargs + node.args
            pairs += [(a.arg, d) for a, d in zip(positional[len(positional) - len(node.defaults):], node.defaults)]
            pairs += [(a.arg, d) for a, d in zip(node.kwonlyargs, node.kw_defaults)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            pairs.append((node.target.id, node.value))
        elif isinstance(node, ast.Assign):
            pairs += [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.keyword):
            pairs.append((node.arg, node.value))
        found += [(value.lineno, value.value) for name, value in pairs
                  if name and name.endswith(name_suffix) and isinstance(value, ast.Constant)
                  and type(value.value) is int]
    return found


def test_the_default_max_tokens_is_one_constant():
    """A request that names no max_tokens gets engine.config.DEFAULT_MAX_TOKENS, in the engine's
    SamplingParams and the router's completions alike: no second literal of it anywhere."""
    literals = [f"{path.relative_to(ROOT)}:{line}" for package in PRODUCT for path in (ROOT / package).rglob("*.py")
                if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
                for line, value in _int_defaults(ast.parse(path.read_text(encoding="utf-8")), "max_tokens")
                if value == DEFAULT_MAX_TOKENS]
    assert literals == [], "use engine.config.DEFAULT_MAX_TOKENS:\n" + "\n".join(literals)
    tree = ast.parse("def f(a, max_tokens=16, *, default_max_tokens=16): pass\nmax_tokens: int = 16\ng(max_tokens=16)")
    assert sorted(_int_defaults(tree, "max_tokens")) == [(1, 16), (1, 16), (2, 16), (3, 16)]


# kvtransfer may not import engine (tests/test_architecture.py): its benchmark keeps its own.
CDIV_COPIES_ALLOWED = {"engine/math_utils.py", "kvtransfer/bench.py"}


def test_ceiling_division_is_cdiv():
    """``-(-n // d)`` is written once, as engine.math_utils.cdiv; the product calls that."""
    copies = [f"{path.relative_to(ROOT)}:{n}" for package in PRODUCT for path in (ROOT / package).rglob("*.py")
              if path.relative_to(ROOT).as_posix() not in CDIV_COPIES_ALLOWED
              for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
              if re.search(r"-\(-.*//", line)]
    assert copies == [], "use engine.math_utils.cdiv:\n" + "\n".join(copies)


def test_the_start_up_heap_is_frozen_in_one_place():
    """The router and every worker rank freeze their start-up heap with protos.process.freeze_heap."""
    copies = [f"{path.relative_to(ROOT)}:{n}" for package in PRODUCT for path in (ROOT / package).rglob("*.py")
              if path.relative_to(ROOT).as_posix() != "protos/process.py"
              for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
              if re.search(r"\bgc\.freeze\(|^\s*def freeze_heap\b", line)]
    assert copies == [], "use protos.process.freeze_heap:\n" + "\n".join(copies)


def _string_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every str literal but docstrings, f-strings' literal parts included."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def _pool_copies(tree: ast.AST) -> list[int]:
    """Lines with the pool directory as a path or the pool name prefix written out (prose that
    names /dev/shm in a message or help text is not a copy)."""
    from tandem_shm.pools import POOL_PREFIX, SHM_DIR

    return sorted(line for line, text in _string_literals(tree)
                  if text.rstrip("/") == SHM_DIR or text.startswith(SHM_DIR + "/") or POOL_PREFIX in text)


def test_the_pool_directory_and_name_prefix_are_written_once():
    """Engine, kvtransfer and the launchers find and make pools through tandem_shm.pools (SHM_DIR,
    POOL_PREFIX, pools_of, ...): a literal copy elsewhere, under any name, is caught."""
    copies = [f"{path.relative_to(ROOT)}:{line}" for package in PRODUCT for path in (ROOT / package).rglob("*.py")
              if path.relative_to(ROOT).as_posix() != "tandem_shm/pools.py"
              for line in _pool_copies(ast.parse(path.read_text(encoding="utf-8")))]
    assert copies == [], "use tandem_shm.pools:\n" + "\n".join(copies)
    planted = ast.parse('"""Pools live in /dev/shm as tandem-kv-<pid>-<hex>."""\nSHM = "/dev/shm"\n'
                        'PREFIX = "tandem-kv-"\nglob(f"/dev/shm/x-{pid}")\nraise E(f"enlarge /dev/shm {n}")\n')
    assert _pool_copies(planted) == [2, 3, 4]


def test_copies_across_the_import_ban_agree():
    assert KV_BACKENDS == kvtransfer.BACKENDS == ("auto", *TRANSPORTS)
    assert MAX_REQUEST_ID_LEN == MAX_REQUEST_ID_CHARS
    # The router's internal id is the client's id, "." and 16 hex digits, then ".retry<N>".
    assert MAX_CLIENT_REQUEST_ID_CHARS + len(".0123456789abcdef.retry99") <= MAX_REQUEST_ID_CHARS


def test_only_one_kv_layout_class_name():
    from engine.kv_cache import KVPoolShape
    assert KVPoolShape.__name__ != kvtransfer.KVLayout.__name__


def test_a_worker_process_refuses_the_in_process_fake_backend(capsys):
    from worker.process import parse_args

    assert "fake" not in PROCESS_KV_BACKENDS
    assert parse_args("prefill", ["--kv-backend", "cuda-ipc"]).kv_backend == "cuda-ipc"
    with pytest.raises(SystemExit, match="2"):
        parse_args("prefill", ["--kv-backend", "fake"])
    assert "invalid choice: 'fake'" in capsys.readouterr().err
    assert WorkerConfig(kv_backend="fake").kv_backend == "fake"   # the in-process twin still may


@pytest.mark.parametrize("cls", [ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, WorkerConfig])
def test_every_flag_has_its_help_on_the_field(cls):
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in NOT_FLAGS and not f.metadata.get("help")]
    assert missing == []
