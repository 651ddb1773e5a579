"""The shipped monitoring for real: `tandem serve` on a tiny random model, a real Prometheus
(Debian's `prometheus`) started with deploy/prometheus/prometheus.yml pointed at the target file
the controller wrote, and every PromQL query of deploy/grafana/tandem.json answered with data.

Also that the target file follows membership: a decode replica added with `tandem scale` is
listed and scraped, and `tandem down` empties the list. Set TANDEM_DASHBOARD_RESULTS=PATH to keep
every query's answer in a text file (what each panel would draw at that moment).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.serving import interrupt, start_serve, wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tandem.json"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROMETHEUS = shutil.which("prometheus")
# What Grafana would put in for its variables; the window spans the whole test's traffic.
GRAFANA_VARS = {"$__rate_interval": "2m", "$__interval": "15s", "$__range": "10m"}

needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed "
                                                                 "(apt-get install prometheus; .ci/run does)")


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL with Grafana's variables filled in) for every target."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{panel['title']}: a Grafana variable this test does not fill in: {expr}"
            out.append((panel["title"], target.get("legendFormat", ""), expr))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus process on 127.0.0.1 with the shipped config, its target file replaced."""

    def __init__(self, tmp_path: Path, sd_file: Path) -> None:
        config = yaml.safe_load(PROMETHEUS_YML.read_text())
        config["global"].update(scrape_interval="1s", scrape_timeout="1s")   # a test cannot wait 5 s per scrape
        (job,) = config["scrape_configs"]
        job["file_sd_configs"][0]["files"] = [str(sd_file)]
        tmp_path.mkdir(parents=True, exist_ok=True)
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tmp_path / "prometheus.log"
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={path}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        wait_for(self._ready, "Prometheus ready", 60)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited:\n{self.log.read_text()[-3000:]}"
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "success", f"{expr}: {r.text}"
        return r.json()["data"]["result"]

    def peaks(self, expr: str, since_s: float) -> dict[str, float]:
        """Each series' largest finite value over the last ``since_s`` seconds, at 1 s steps."""
        now = time.time()
        r = httpx.get(f"{self.url}/api/v1/query_range",
                      params={"query": expr, "start": now - since_s, "end": now, "step": "1s"}, timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "success", f"{expr}: {r.text}"
        out = {}
        for series in r.json()["data"]["result"]:
            values = [float(v) for _, v in series["values"] if math.isfinite(float(v))]
            if values:
                out[labels_text(series["metric"])] = max(values)
        return out

    def up(self) -> dict[str, float]:
        """Replica label -> up, for the targets of the last scrape."""
        return {s["metric"].get("replica", "?"): float(s["value"][1]) for s in self.query('up{job="tandem"}')}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def finite(series: list[dict]) -> list[float]:
    return [float(s["value"][1]) for s in series if math.isfinite(float(s["value"][1]))]


def stream_completions(http: str, model: str, prompts: list[str], max_tokens: int) -> list[int]:
    """Concurrent streaming completions; each one's number of streamed chunks with text."""
    async def one(client: httpx.AsyncClient, prompt: str) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        chunks = 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    chunks += 1
        return chunks

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=http, timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))
    return asyncio.run(main())


def labels_text(metric: dict[str, str]) -> str:
    return "{" + ",".join(f"{k}={v}" for k, v in sorted(metric.items())) + "}"


def describe(title: str, legend: str, expr: str, series: list[dict], peaks: dict[str, float]) -> str:
    """One query's answer now, and each series' peak while the test's traffic ran."""
    lines = [f"## {title} -- {legend or '(no legend)'}", f"   {expr}"]
    for s in series:
        labels = labels_text(s["metric"])
        lines.append(f"   {labels} = {float(s['value'][1]):.6g} now, peak {peaks.get(labels, float('nan')):.6g}")
    if not series:
        lines.append("   (no data)")
    return "\n".join(lines)


@needs_prometheus
def test_prometheus_scrapes_serve_and_every_dashboard_query_has_data(tmp_path, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    sd_file = tmp_path / "sd" / "targets.json"
    # A small pool (512 blocks of 16 tokens), so the KV usage panel has something to show; local
    # prefill off, so every prompt crosses the prefill worker and the KV transfer panels have data.
    dep = start_serve(tmp_path / "serve", "--model", model, "--num-gpu-blocks-override", "512",
                      "--max-model-len", "512", "--log-interval-s", "0.5", "--prometheus-sd-file", str(sd_file),
                      "--local-prefill-max-tokens", "0")
    prometheus = None
    try:
        # The controller republishes the target file every reconcile tick (0.5 s): a worker that just
        # became ready may reach it a tick after `tandem serve` says it is serving.
        deadline = time.monotonic() + 10
        while True:
            groups = json.loads(sd_file.read_text())
            if len(groups) == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sorted(g["labels"]["replica"] for g in groups) == ["decode-0", "prefill-0", "router"]
        assert {g["labels"]["role"] for g in groups} == {"router", "prefill", "decode"}
        router = next(g for g in groups if g["labels"]["role"] == "router")
        assert router["targets"] == [dep.http.removeprefix("http://")]

        prometheus = Prometheus(tmp_path / "prometheus", sd_file)
        wait_for(lambda: prometheus.up() == {"router": 1.0, "prefill-0": 1.0, "decode-0": 1.0},
                 "Prometheus scraping the router and both workers", 60)
        # Traffic after the first scrape, so rates see it: a shared prefix (prefix-cache hits),
        # concurrent streams (a decode batch, queues), then a pause of a few scrapes.
        traffic_start_s = time.monotonic()
        prefix = "Tell me a long story about the sea and the ships that sail on it, " * 3
        for round_ in range(3):
            chunks = stream_completions(dep.http, model, [f"{prefix} number {round_}-{i}" for i in range(6)], 160)
            assert all(n > 1 for n in chunks), chunks
            time.sleep(1.5)
        time.sleep(3)

        report, empty = [], []
        for title, legend, expr in dashboard_queries():
            series = prometheus.query(expr)
            peaks = prometheus.peaks(expr, time.monotonic() - traffic_start_s + 2)
            report.append(describe(title, legend, expr, series, peaks))
            if not finite(series):
                empty.append(f"{title} [{legend}]: {expr} -> {series}")
        out = Path(os.environ.get("TANDEM_DASHBOARD_RESULTS") or tmp_path / "dashboard_queries.txt")
        out.write_text("\n\n".join(report) + "\n")
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

        # The numbers mean what the panels say.
        ttft = {s["metric"]["role"]: float(s["value"][1]) for s in prometheus.query(
            'sum by (role) (tandem_time_to_first_token_seconds_count)')}
        assert ttft == {"router": 18.0, "prefill": 18.0, "decode": 18.0}
        assert finite(prometheus.query('sum(tandem_time_per_output_token_seconds_count)')) == [18.0]
        hits = finite(prometheus.query('sum(tandem_prefix_cache_hits_total{role="prefill"})'))
        assert hits and hits[0] > 0, "requests sharing a long prefix found nothing in the prefix cache"
        moved = finite(prometheus.query('sum(tandem_kv_transfer_bytes_total{role="prefill"})'))
        assert moved and moved[0] > 0

        # Membership: a replica added is listed and scraped, with the labels the panels group by.
        dep.cli("scale", "decode", "2")
        wait_for(lambda: prometheus.up().get("decode-1") == 1.0, "the new decode replica scraped", 120, dep)
        usage = prometheus.query('tandem_kv_cache_usage_ratio{replica="decode-1"}')
        assert [s["metric"]["role"] for s in usage] == ["decode"]
        dep.cli("down")
        assert dep.proc.wait(60) == 0, dep.log_tail()
        assert json.loads(sd_file.read_text()) == []
    finally:
        if prometheus is not None:
            prometheus.stop()
        interrupt(dep.proc)


def test_every_dashboard_query_parses_into_known_variables():
    queries = dashboard_queries()
    assert len(queries) >= 20
    assert all(re.search(r"\btandem_|\bup\{", expr) for _, _, expr in queries)
