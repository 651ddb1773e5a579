"""Repo rules for kvtransfer: no pickle anywhere, imports only numpy/torch/zmq/msgpack."""
from __future__ import annotations

import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "kvtransfer").glob("*.py"))
ALLOWED_THIRD_PARTY = {"numpy", "torch", "zmq", "msgpack"}
PICKLE_USE = re.compile(
    r"import\s+(c?pickle|cloudpickle|dill)\b|from\s+(c?pickle|cloudpickle|dill)\b"
    r"|\b(c?pickle|cloudpickle|dill)\.\w+\(|_pyobj\(|torch\.(load|save)\(|allow_pickle\s*=\s*True"
    r"|multiprocessing\.reductions|ForkingPickler")


def test_sources_found():
    assert {p.name for p in SOURCES} >= {"__init__.py", "layout.py", "messages.py", "receiver.py",
                                         "sender.py", "shm.py", "tcp.py", "cuda_ipc.py", "fake.py"}


def test_no_pickle_anywhere():
    files = SOURCES + sorted((ROOT / "tests" / "kvtransfer").glob("*.py"))
    offenders = [f"{p.name}:{i}" for p in files if p.name != "test_hygiene.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if PICKLE_USE.search(line)]
    assert offenders == []
    assert PICKLE_USE.search("sock." + "recv_pyobj()") and PICKLE_USE.search("import " + "pickle")


def test_imports_point_one_way():
    bad = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ALLOWED_THIRD_PARTY:
                    bad.append(f"{path.name}: {name}")
    assert bad == []


def test_no_hard_coded_ports():
    port = re.compile(r"tcp://[^\"']*:\d{2,5}")
    assert [p.name for p in SOURCES if port.search(p.read_text())] == []
