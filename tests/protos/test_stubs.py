"""The committed generated stubs equal a fresh generation; ids round-trip at full width."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from protos.generate import PROTO_ROOT


def test_committed_stubs_match_fresh_generation(tmp_path):
    pytest.importorskip("grpc_tools")
    # In a child: grpc_tools' protoc extension segfaulted on import in a process that the nixl
    # tests had loaded NIXL/UCX into (the full CI run, 2026-11-27).
    code = f"from pathlib import Path; from protos.generate import generate; generate(out_dir=Path({str(tmp_path)!r}))"
    subprocess.run([sys.executable, "-c", code], cwd=PROTO_ROOT.parent, check=True, timeout=120)
    fresh = sorted(tmp_path.rglob("*_pb2*.py*"))
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = PROTO_ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is not committed: run python -m protos.generate"
        assert committed.read_text() == path.read_text(), \
            f"{committed} differs from a fresh generation: run python -m protos.generate"


def test_largest_ids_round_trip():
    from protos.tandem.v1 import worker_pb2

    big = 2**63 - 1
    msg = worker_pb2.SetDestinationRequest(request_id="r" * 64, block_ids=[0, big])
    back = worker_pb2.SetDestinationRequest.FromString(msg.SerializeToString())
    assert list(back.block_ids) == [0, big] and back.request_id == "r" * 64
    gen = worker_pb2.GenerateResponse(token_ids=[big])
    assert list(worker_pb2.GenerateResponse.FromString(gen.SerializeToString()).token_ids) == [big]


def test_unset_optional_sampling_fields_are_distinguishable():
    from protos.tandem.v1 import worker_pb2

    params = worker_pb2.SamplingParams(temperature=0.0)
    assert params.HasField("temperature") and not params.HasField("top_p")
    assert Path(PROTO_ROOT / "tandem" / "v1" / "worker.proto").is_file()
