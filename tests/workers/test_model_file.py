"""A worker started on a malformed model file prints one line naming the file and the field and
exits 2, the code of every configuration error (worker/process.py) -- not a traceback
and a crash loop. Real ``python -m prefill_worker`` / ``decode_worker`` processes."""
from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from tests.workers.harness import REPO_ROOT


def _kv(key: str, value_type: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", value_type) + payload


_NESTED_ARRAYS = _kv("deep", 9, struct.pack("<IQ", 9, 1) * 100_000 + struct.pack("<IQ", 4, 0))
_ZERO_ALIGNMENT = _kv("general.alignment", 4, struct.pack("<I", 0))


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("kv, field", [(_NESTED_ARRAYS, "metadata 'deep'"),
                                       (_ZERO_ALIGNMENT, "metadata 'general.alignment'")])
def test_worker_on_a_malformed_gguf_exits_2_with_one_line(tmp_path, role, kv, field):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
    proc = subprocess.run([sys.executable, "-m", f"{role}_worker", "--model", str(path), "--port", "0",
                           "--metrics-port", "-1", "--device", "cpu"],
                          cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{role} worker: error: {path} is not a valid GGUF file: {field}: ")
