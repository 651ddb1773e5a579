"""Repo rules for kvtransfer: imports only numpy/torch/zmq/msgpack (and, of the project, the
shared-memory pool leaf tandem_shm), no hard-coded ports.

(No-pickle and the import direction of every package: tests/test_architecture.py.)
"""
from __future__ import annotations

import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "kvtransfer").glob("*.py"))
ALLOWED_THIRD_PARTY = {"numpy", "torch", "zmq", "msgpack"}
ALLOWED_PROJECT = {"tandem_shm"}   # standard library only (tests/test_architecture.py)


def test_sources_found():
    assert {p.name for p in SOURCES} >= {"__init__.py", "layout.py", "messages.py", "receiver.py",
                                         "sender.py", "shm.py", "tcp.py", "cuda_ipc.py", "fake.py"}


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
                if top not in sys.stdlib_module_names and top not in ALLOWED_THIRD_PARTY | ALLOWED_PROJECT:
                    bad.append(f"{path.name}: {name}")
    assert bad == []


def test_no_hard_coded_ports():
    port = re.compile(r"tcp://[^\"']*:\d{2,5}")
    assert [p.name for p in SOURCES if port.search(p.read_text())] == []
