"""House rules a machine can check: import direction and no pickle (docs/architecture.md)."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kvtransfer", "worker", "router", "prefill_worker", "decode_worker", "protos", "deploy",
            "tandem_client", "tandem_shm")
# torch-free (the last test below)
ROUTER_MAY_USE = ("engine.tokenizer", "engine.config", "engine.fingerprint")
# package -> top-level modules it must never import
BANNED = {
    "engine": {"worker", "router", "prefill_worker", "decode_worker", "deploy", "kvtransfer", "protos",
               "tandem_client"},
    "kvtransfer": {"engine", "worker", "router", "prefill_worker", "decode_worker", "deploy", "tandem_client"},
    # The plumbing both roles share (servers, processes, sessions, metrics): it knows no role.
    "worker": {"prefill_worker", "decode_worker", "router", "deploy", "tandem_client"},
    "prefill_worker": {"decode_worker", "router", "deploy", "tandem_client"},
    "decode_worker": {"prefill_worker", "router", "deploy", "tandem_client"},
    "router": {"worker", "prefill_worker", "decode_worker", "torch", "triton", "deploy", "tandem_client", "tandem_shm"},
    "protos": {"engine", "kvtransfer", "worker", "router", "prefill_worker", "decode_worker", "deploy", "torch",
               "tandem_client", "tandem_shm"},
}
# Packages that may import, beyond the standard library and themselves, only these.
# The client SDK runs in the user's process: grpc and protos only, so installing Tandem's server
# side is never its price. The shared-memory pools are a leaf below engine and kvtransfer, which
# may not import each other: nothing else.
MAY_USE_ONLY = {
    "tandem_client": {"tandem_client", "protos", "grpc", "google"},
    "tandem_shm": {"tandem_shm"},
}
# Where code that imports Tandem lives outside the product packages (the SDK moved out of the router).
CLIENT_CODE = ("tests", "benchmarks", "scripts")
PICKLE = re.compile(r"\b(pickle|cPickle|cloudpickle|dill)\b|recv_pyobj|send_pyobj")


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_imports_point_one_way():
    wrong = []
    for package, banned in BANNED.items():
        for path in (ROOT / package).rglob("*.py"):
            for lineno, module in _imports(path):
                if package == "router" and module.startswith("engine") and module not in ROUTER_MAY_USE:
                    wrong.append(f"{path.relative_to(ROOT)}:{lineno} imports {module} "
                                 f"(router may use {', '.join(ROUTER_MAY_USE)} only)")
                elif module.split(".")[0] in banned:
                    wrong.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert not wrong, "imports against docs/architecture.md#packages-and-import-direction:\n" + "\n".join(wrong)


def _import_problems(path: Path, may_use: set[str]) -> list[str]:
    """What ``path`` imports beyond the standard library and ``may_use`` (top-level names)."""
    return [f"{lineno} imports {module}" for lineno, module in _imports(path)
            if module.split(".")[0] not in may_use | set(sys.stdlib_module_names)]


@pytest.mark.parametrize("package", sorted(MAY_USE_ONLY))
def test_leaf_packages_import_only_what_they_may(package):
    wrong = [f"{path.relative_to(ROOT)}:{problem}" for path in (ROOT / package).rglob("*.py")
             for problem in _import_problems(path, MAY_USE_ONLY[package])]
    assert not wrong, f"{package} may import only {sorted(MAY_USE_ONLY[package])}:\n" + "\n".join(wrong)


def _imports_of(path: Path, module: str) -> list[int]:
    """Lines of ``path`` that import ``module`` (``import a.b``, ``from a.b import x``, ``from a import b``)."""
    parent, _, name = module.rpartition(".")
    direct = [lineno for lineno, imported in _imports(path) if imported == module or imported.startswith(module + ".")]
    return direct + [node.lineno for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                     if isinstance(node, ast.ImportFrom) and node.module == parent
                     and any(a.name == name for a in node.names)]


def test_nothing_imports_the_sdk_from_the_router():
    assert not (ROOT / "router" / "client.py").exists()
    wrong = [f"{path.relative_to(ROOT)}:{lineno} imports router.client (the SDK is tandem_client)"
             for folder in PACKAGES + CLIENT_CODE for path in (ROOT / folder).rglob("*.py")
             for lineno in _imports_of(path, "router.client")]
    assert not wrong, "\n".join(wrong)


def test_import_checker_catches_a_wrong_arrow(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import router.client\nfrom decode_worker import x\nimport os, grpc\nfrom protos import limits\n")
    assert [m for _, m in _imports(bad)] == ["router.client", "decode_worker", "os", "grpc", "protos"]
    wrong_arrows = ["1 imports router.client", "2 imports decode_worker"]
    assert _import_problems(bad, MAY_USE_ONLY["tandem_client"]) == wrong_arrows
    assert _import_problems(bad, MAY_USE_ONLY["tandem_shm"]) == [*wrong_arrows, "3 imports grpc", "4 imports protos"]
    bad.write_text("from router import client\nfrom router.client import TandemClient\nimport router.clientele\n")
    assert sorted(_imports_of(bad, "router.client")) == [1, 2]


def test_tensor_parallelism_is_one_package_of_engine():
    """engine/tp/ holds the rank group, a follower's process and their spawning: no TP module
    sits loose in engine/, and nothing outside engine/tp/ talks torch.distributed itself."""
    loose = sorted(p.name for p in (ROOT / "engine").glob("*.py") if p.stem.startswith("tp") or p.stem == "distributed")
    assert not loose, f"tensor-parallel modules outside engine/tp/: {loose}"
    tp = ROOT / "engine" / "tp"
    wrong = [f"{path.relative_to(ROOT)}:{lineno} imports torch.distributed (engine/tp/ is its one user)"
             for package in PACKAGES for path in (ROOT / package).rglob("*.py") if tp not in path.parents
             for lineno in _imports_of(path, "torch.distributed")]
    assert not wrong, "\n".join(wrong)


def test_no_pickle_in_the_product():
    hits = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if PICKLE.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not hits, "pickle-family use (docs/architecture.md#wire-formats forbids it):\n" + "\n".join(hits)


def test_engine_package_and_tokenizer_import_without_torch():
    code = ("import sys, engine, engine.config, engine.tokenizer, engine.block_manager, engine.fingerprint; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_cli_and_controller_import_without_torch():
    """`tandem serve` reads the workers' flags (worker.config) and the controller their READY line
    (worker.process) without loading torch, which is why worker.config keeps its own copy of
    kvtransfer's backend names (tests/test_one_fact.py)."""
    code = "import sys, deploy.cli, deploy.serve, deploy.controller, worker.config, worker.process; " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# The workers use LLMEngine's own API (reserve/free blocks, add_prefilled, compile_grammar,
# held_request, step's PromptChunks and StepOutputs, stats(), kv_pool, ...), never the engine's
# parts or its requests' state: what reaches in cannot be changed behind its back. The API hands
# out no Sequence, and a Sequence's own fields are not read where a worker could reach one.
ENGINE_PARTS = {"allocator", "scheduler", "runner", "grammars", "held", "sequences",
                "is_finished", "output_token_ids", "num_computed_tokens", "num_uncomputed_tokens",
                "all_token_ids", "num_cached_blocks"}
ENGINE_PART_MODULES = ("engine.scheduler", "engine.sequence", "engine.block_manager", "engine.structured")
NARROW_API_USERS = ("prefill_worker", "decode_worker", "worker")


def _engine_part_uses(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS:
            found.append((node.lineno, f".{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in ENGINE_PARTS):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return sorted(found)


def test_workers_use_only_the_engines_narrow_api():
    wrong = [f"{path.relative_to(ROOT)}:{lineno} uses {what}"
             for folder in NARROW_API_USERS for path in (ROOT / folder).rglob("*.py")
             for lineno, what in _engine_part_uses(path)]
    wrong += [f"{path.relative_to(ROOT)}:{lineno} imports {module}"
              for folder in NARROW_API_USERS for path in (ROOT / folder).rglob("*.py")
              for module in ENGINE_PART_MODULES for lineno in _imports_of(path, module)]
    assert not wrong, "workers reach into the engine's parts (use LLMEngine's API):\n" + "\n".join(wrong)


def test_the_engines_api_hands_out_no_request_state():
    """LLMEngine's public methods return plain records (StepOutput, PromptChunk, HeldRequest,
    EngineStats, block ids), never a Sequence or a ScheduledBatch a worker could read or change."""
    tree = ast.parse((ROOT / "engine" / "llm_engine.py").read_text(encoding="utf-8"))
    [engine_class] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "LLMEngine"]
    wrong = [f"LLMEngine.{node.name} returns {ast.unparse(node.returns)}" for node in engine_class.body
             if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and node.returns is not None
             and re.search(r"\b(Sequence|ScheduledBatch)\b", ast.unparse(node.returns))]
    assert not wrong, "\n".join(wrong)


def test_engine_part_checker_catches_a_reach_in(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("self.engine.allocator.free(ids)\nn = loop.engine.runner.arch.vocab_size\n"
                   "q = len(engine.scheduler.waiting)\ngetattr(engine, 'allocator')\nscheduler_config = 1\n"
                   "done = seq.is_finished\n")
    assert _engine_part_uses(bad) == [(1, ".allocator"), (2, ".runner"), (3, ".scheduler"),
                                      (4, "getattr(..., 'allocator')"), (6, ".is_finished")]
