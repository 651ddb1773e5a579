"""`tandem bench` end to end against stub servers written here (OpenAI SSE over http.server,
and Tandem's gRPC service), in a real subprocess where the command line is the point."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from deploy.bench.plots import PLOT_FILES
from deploy.cli import main
from tests.fake_tandem_service import generate_only_tandem_server

ROOT = Path(__file__).resolve().parents[2]
CHUNK_DELAY_S = 0.002
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class StubBehavior:
    tokens_per_chunk: int = 2
    send_usage: bool = True
    fail_every: int = 0          # every n-th request (1-based) gets HTTP 500
    bodies: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(behavior: StubBehavior):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _event(self, obj) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with behavior.lock:
                behavior.bodies.append({"path": self.path, **body})
                n = len(behavior.bodies)
            if behavior.fail_every and n % behavior.fail_every == 0:
                self.send_response(500)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"error": "stub overloaded"}')
                return
            chat = self.path == "/v1/chat/completions"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b": ping\n\n")
            if chat:   # the role-only first chunk carries no content and must not start TTFT
                self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for _ in range(body["max_tokens"] // behavior.tokens_per_chunk):
                time.sleep(CHUNK_DELAY_S)
                text = "tok " * behavior.tokens_per_chunk
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                self._event({"choices": [choice]})
            self._event({"choices": [{"index": 0, "finish_reason": "length",
                                      **({"delta": {}} if chat else {"text": ""})}]})
            if behavior.send_usage:
                self._event({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": body["max_tokens"]}})
            self._event("[DONE]")
    return Handler


@pytest.fixture
def stub() -> Iterator[tuple[str, StubBehavior]]:
    behavior = StubBehavior()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(behavior))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", behavior
    server.shutdown()
    server.server_close()
    thread.join(5)


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", "bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


LOAD = ("--dataset", "random", "--input-len", "16", "--output-len", "8", "--num-prompts", "12",
        "--request-rate", "inf", "--max-concurrency", "4", "--no-progress")


@pytest.mark.parametrize(("backend", "path"), [("openai-chat", "/v1/chat/completions"),
                                               ("openai", "/v1/completions")])
def test_bench_openai_backends_write_results_and_plots(stub, tmp_path, backend, path):
    url, behavior = stub
    out = tmp_path / backend
    proc = _bench("--backend", backend, "--base-url", url, *LOAD, "--ignore-eos", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Successful requests:" in proc.stdout and "Mean TTFT (ms):" in proc.stdout
    data = json.loads((out / "results.json").read_text())
    s = data["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (12, 0, 96)
    assert s["total_input_tokens"] == sum(r["prompt_len"] for r in data["requests"])
    assert s["output_throughput"] == pytest.approx(96 / s["duration_s"])
    assert len(data["requests"]) == 12
    for r in data["requests"]:
        assert r["success"] and r["error"] == "" and r["output_len"] == 8
        assert abs(r["prompt_len"] - 16) <= 2
        assert len(r["itl_s"]) == 3      # four chunks of two tokens: ITL is per chunk
        assert 0 < r["ttft_s"] < r["e2e_s"]
        assert r["ttft_s"] >= CHUNK_DELAY_S
    assert data["config"]["endpoint"]["backend"] == backend and "api_key" not in data["config"]["endpoint"]
    for name in PLOT_FILES:
        assert _png_size(out / name) == (1000, 600), name
        assert (out / name).stat().st_size > 5000
    assert len(behavior.bodies) == 12
    for body in behavior.bodies:
        assert body["path"] == path
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert (body["max_tokens"], body["temperature"], body["ignore_eos"]) == (8, 0.0, True)
        assert body["model"] == "smollm2-135m-instruct"
        assert ("messages" in body) == (backend == "openai-chat") and ("prompt" in body) == (backend == "openai")


def test_bench_counts_http_500_as_failed_and_counts_chunks_without_usage(stub, tmp_path):
    url, behavior = stub
    behavior.fail_every, behavior.send_usage, behavior.tokens_per_chunk = 3, False, 1
    out = tmp_path / "fail"
    proc = _bench("--backend", "openai-chat", "--base-url", url, *LOAD, "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (8, 4, 64)
    records = json.loads((out / "results.json").read_text())["requests"]
    failed = [r for r in records if not r["success"]]
    assert len(failed) == 4
    assert all(r["error"] == 'HTTP 500: {"error": "stub overloaded"}' for r in failed)
    assert all(r["output_len"] == 0 and r["itl_s"] == [] for r in failed)
    assert all(len(r["itl_s"]) == 7 and r["output_len"] == 8 for r in records if r["success"])
    assert "ignore_eos" not in behavior.bodies[0]


def test_bench_compare_prints_ratios(tmp_path):
    def results(path: Path, throughput: float, ttft: float) -> Path:
        path.write_text(json.dumps({"summary": {"completed": 12, "request_throughput": throughput,
                                                "mean_ttft_ms": ttft, "request_goodput": None}}))
        return path
    a, b = results(tmp_path / "a.json", 2.0, 40.0), results(tmp_path / "b.json", 3.0, 10.0)
    proc = _bench("--compare", str(a), str(b))
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[2:]}
    assert rows == {"completed": ["12", "12", "1.000"], "request_throughput": ["2.00", "3.00", "1.500"],
                    "mean_ttft_ms": ["40.00", "10.00", "0.250"], "request_goodput": ["-", "-", "n/a"]}


def test_bench_bad_inputs_exit_2_with_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"prompt": "x", "max_tokens": -1}\n')
    cases = [
        (["--dataset-path", str(bad)], f"{bad}:2: 'max_tokens' must be a positive integer, got -1"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
        (["--request-rate", "0"], "--request-rate must be > 0 (or inf), got 0.0"),
        (["--base-url", "localhost:8000"], "--base-url must start with http:// or https://"),
        (["--compare", str(tmp_path / "a.json"), str(bad)], "cannot read results file"),
    ]
    for args, message in cases:
        assert main(["bench", "--no-progress", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("tandem bench: error: ") and message in err, (args, err)


def test_bench_unreachable_server_fails_every_request(tmp_path, capsys):
    import socket

    with socket.socket() as s:          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "3", "--input-len", "4",
                 "--output-len", "2", "--no-progress", "--json"]) == 1
    summary = json.loads(capsys.readouterr().out.strip())
    assert (summary["completed"], summary["failed"]) == (0, 3)


# --- gRPC backend, against a stub of Tandem's service --------------------------------------------

def test_bench_grpc_backend(tmp_path, capsys):
    server, stub, port = generate_only_tandem_server(CHUNK_DELAY_S)
    try:
        code = main(["bench", "--backend", "grpc", "--grpc-target", f"127.0.0.1:{port}", "--dataset", "random",
                     "--input-len", "16", "--output-len", "8", "--num-prompts", "6", "--max-concurrency", "3",
                     "--no-progress", "--json", "--ignore-eos"])
    finally:
        server.stop(None)
    assert code == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.strip())
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (6, 0, 48)
    assert len(stub.requests) == 6
    assert len({r.request_id for r in stub.requests}) == 6
    assert all(r.sampling.max_tokens == 8 and r.sampling.ignore_eos and r.sampling.temperature == 0.0
               and r.model == "smollm2-135m-instruct" and r.prompt for r in stub.requests)
