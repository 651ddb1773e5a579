"""Regenerate the Python stubs for every .proto under protos/ (run from anywhere).

    python -m protos.generate

Generated modules land next to their sources (protos/tandem/v1/*_pb2*.py) and are committed;
tests/protos/test_stubs.py fails when they differ from a fresh generation.
"""
from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    from grpc_tools import protoc

    sources = sorted(PROTO_ROOT.rglob("*.proto"))
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *map(str, sources)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(map(str, sources))}")
    # grpc_tools writes absolute imports (`from tandem.v1 import x_pb2`); make them
    # package-relative so the stubs import as protos.tandem.v1.*.
    for path in out_dir.rglob("*_pb2_grpc.py"):
        text = path.read_text()
        path.write_text(text.replace("from tandem.v1 import", "from protos.tandem.v1 import"))
    return sorted(out_dir.rglob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate():
        print(path)
    sys.exit(0)
