"""The controller's Prometheus target list (deploy/prometheus_sd.py) and the shipped scrape config
and dashboard, without processes: exact file_sd groups, atomic rewrites only on change, and
every metric the dashboard names exported by the router's or a worker's registry."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from deploy.prometheus_sd import DEFAULT_SD_FILE, TargetFile, scrape_address, target_groups
from router.metrics import RouterMetrics
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tandem.json"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"


@dataclass
class FakeReplica:
    """The fields of deploy.controller.Replica that target_groups reads."""

    id: str
    role: str
    state: str
    node: str = "10.0.0.5"
    metrics: str = ""


ROUTER = {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:50051", "node": "10.0.0.5", "pid": 1}


def test_groups_list_the_router_and_serving_replicas_only():
    replicas = [FakeReplica("prefill-0", "prefill", "running", metrics="127.0.0.1:9101"),
                FakeReplica("decode-1", "decode", "draining", metrics="127.0.0.1:9103"),
                FakeReplica("decode-0", "decode", "running", metrics="127.0.0.1:9102"),
                FakeReplica("decode-2", "decode", "starting", metrics="127.0.0.1:9104"),
                FakeReplica("prefill-1", "prefill", "restarting", metrics="127.0.0.1:9105"),
                FakeReplica("prefill-2", "prefill", "running", metrics="")]     # --metrics-port -1
    assert target_groups(ROUTER, replicas) == [
        {"targets": ["127.0.0.1:9102"], "labels": {"role": "decode", "replica": "decode-0", "node": "10.0.0.5"}},
        {"targets": ["127.0.0.1:9103"], "labels": {"role": "decode", "replica": "decode-1", "node": "10.0.0.5"}},
        {"targets": ["127.0.0.1:9101"], "labels": {"role": "prefill", "replica": "prefill-0", "node": "10.0.0.5"}},
        {"targets": ["127.0.0.1:8000"], "labels": {"role": "router", "replica": "router", "node": "10.0.0.5"}},
    ]
    assert target_groups({}, []) == []
    assert target_groups({}, [], planner="127.0.0.1:9200") == [
        {"targets": ["127.0.0.1:9200"], "labels": {"role": "planner", "replica": "planner", "node": "127.0.0.1"}}]


def test_a_wildcard_bind_is_scraped_at_the_node_address():
    assert scrape_address("0.0.0.0:8000", "10.0.0.7") == "10.0.0.7:8000"
    assert scrape_address("[::]:8000", "10.0.0.7") == "10.0.0.7:8000"
    assert scrape_address("10.0.0.9:9101", "10.0.0.7") == "10.0.0.9:9101"
    assert scrape_address("0.0.0.0:8000", "") == "0.0.0.0:8000"
    groups = target_groups({**ROUTER, "http": "0.0.0.0:8000"}, [])
    assert groups[0]["targets"] == ["10.0.0.5:8000"]


def test_target_file_is_rewritten_atomically_and_only_on_change(tmp_path):
    path = tmp_path / "sd" / "targets.json"
    targets = TargetFile(path)
    one = target_groups(ROUTER, [FakeReplica("decode-0", "decode", "running", metrics="127.0.0.1:9102")])
    assert targets.publish(one) is True
    assert json.loads(path.read_text()) == one
    assert path.stat().st_mode & 0o777 == 0o644
    inode = path.stat().st_ino
    assert targets.publish(list(one)) is False                    # same membership: no write
    assert path.stat().st_ino == inode
    assert targets.publish(one[:1]) is True                       # a replica left: a new file renamed in
    assert json.loads(path.read_text()) == one[:1] and path.stat().st_ino != inode
    assert targets.publish([]) is True
    assert json.loads(path.read_text()) == []
    assert sorted(os.listdir(path.parent)) == ["targets.json"]   # no temporary file left behind


def test_an_unwritable_target_file_is_not_fatal(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    targets = TargetFile(blocker / "targets.json")                # its parent is a file
    assert targets.publish([{"targets": ["127.0.0.1:1"], "labels": {}}]) is False


def test_the_shipped_scrape_config_reads_the_default_target_file():
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = config["scrape_configs"]
    assert job["honor_labels"] is True
    assert job["file_sd_configs"][0]["files"] == [DEFAULT_SD_FILE]


def exported_names() -> set[str]:
    """Every sample name the router's and a worker's /metrics can serve."""
    names = set()
    for registry in (RouterMetrics(lambda: 0).registry, WorkerMetrics("prefill").registry):
        for family in registry.collect():
            names |= {sample.name for sample in family.samples}
            # Histogram buckets and counters' _total exist before the first observation.
            if family.type == "histogram":
                names |= {f"{family.name}_bucket", f"{family.name}_count", f"{family.name}_sum"}
            elif family.type == "counter":
                names.add(f"{family.name}_total")
    return names


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_the_dashboard_names_only_exported_metrics():
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    used = {name for e in exprs for name in re.findall(r"\btandem_\w+", e)}
    exported = exported_names()
    assert used - exported == set()
    # The panels the issue asks for have their metrics.
    for name in ("tandem_time_to_first_token_seconds_bucket", "tandem_time_per_output_token_seconds_bucket",
                 "tandem_inter_token_latency_seconds_bucket", "tandem_e2e_request_latency_seconds_bucket",
                 "tandem_num_requests_waiting", "tandem_kv_cache_usage_ratio", "tandem_kv_transfer_bytes_total",
                 "tandem_kv_transfer_seconds_bucket", "tandem_request_success_total", "tandem_request_errors_total"):
        assert name in used, name


def test_dashboard_panels_have_descriptions_and_unique_ids():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        if p["type"] != "row":
            assert p["description"] and p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
