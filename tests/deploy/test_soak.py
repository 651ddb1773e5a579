"""The chaos soak's short version (benchmarks/soak.py; the 10-minute one is a script): `tandem serve`
with 2 prefill + 2 decode workers under mixed streamed load while a worker is kill -9'd every
15 s, 10% of KV transfers fail (TANDEM_KV_FAULT_RATE) and the router is kill -9'd once. Nothing
may be lost, no deterministic answer may differ from the undisturbed run, nothing may fail with a
non-retriable error, and no KV block may stay in use once the load ends."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from deploy.launch import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", REPO_ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_short_chaos_soak_loses_nothing(tmp_path):
    soak = _soak_module()
    args = soak.parse_args(["--duration-s", "50", "--kill-every-s", "15", "--concurrency", "3",
                            "--kv-fault-rate", "0.1", "--log-dir", str(tmp_path)])
    result = soak.run(args)
    soak.print_report(result)
    report = json.dumps({k: v for k, v in result.items() if k != "rss_mib"}, indent=1)
    kills = [e for e in result["chaos"] if "kill -9" in e]
    assert any("router" in e for e in kills) and len(kills) >= 3, report        # the chaos happened
    assert "InjectedFault" in (tmp_path / "chaos.log").read_text(errors="replace"), "no KV fault was injected"
    assert result["completed"] >= 20 and result["compared"] >= 10, report
    assert result["lost"] == 0 and result["failed_other"] == 0, report
    assert result["differing"] == 0, report
    assert not result["kv_blocks_leaked"] and not result["busy_after"], report
