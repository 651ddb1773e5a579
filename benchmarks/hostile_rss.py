"""The router's memory and event loop under hostile requests, against `tandem serve` defaults.

A script, not a timed test (tests/router/test_hostile_*.py check each refusal). It starts
`tandem serve --address local` as a new user would, warms it with a few ordinary requests, then
sends ``--rounds`` rounds of the request classes issue #27's black-box suite found stalling the
router or growing its memory: ~20k tools, 100k empty chat messages, a 12 MB body of 3M one-token
prompts, 3M prompt token ids, a field nested 700 deep, a 4 MB model name, a 4 MB header and
20,000 headers, half a request head left open, and a gRPC ``Complete`` of 3M prompt token ids.
Meanwhile a probe thread times ``GET /health`` every 100 ms. It prints the router's RSS (anon,
MiB) after the warm-up, after every round and after ``--idle-s`` of quiet, the answers each class
got, and the slowest /health. Exit status 0 when every hostile request got a 4xx (or its gRPC
equivalent) and an ordinary request still completes after.

    python benchmarks/hostile_rss.py [--rounds 5] [--idle-s 30] [-- extra `tandem serve` flags]
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx
from soak import REPO_ROOT, Deployment, processes, rss_mib

sys.path.insert(0, str(REPO_ROOT))
from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc  # noqa: E402

HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def http_cases() -> list[tuple[str, str, bytes]]:
    """(name, path, body): built once, reused every round."""
    c, chat = "/v1/completions", "/v1/chat/completions"
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
             for i in range(20_000)]
    return [
        ("20k tools", chat, json.dumps({"messages": HI, "tools": tools, "max_tokens": 1}).encode()),
        ("100k empty messages", chat, json.dumps(
            {"messages": [{"role": "user", "content": ""}] * 100_000, "max_tokens": 1}).encode()),
        ("3M one-token prompts (15 MB)", c, json.dumps({"prompt": ["a"] * 3_000_000, "max_tokens": 1}).encode()),
        ("3M prompt token ids", c, json.dumps({"prompt": [1] * 3_000_000, "max_tokens": 1}).encode()),
        ("field nested 700 deep", c, b'{"prompt": "hi", "max_tokens": 1, "metadata": '
         + b"[" * 700 + b"]" * 700 + b"}"),
        ("4 MB model name", c, json.dumps({"model": "m" * (4 << 20), "prompt": "hi", "max_tokens": 1}).encode()),
        ("tool-call arguments nested 5000 deep", chat, json.dumps(
            {"messages": [*HI, {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
                {"role": "tool", "tool_call_id": "c", "content": "x"}], "tools": [TOOL], "max_tokens": 1}).encode()),
    ]


def raw_cases() -> list[tuple[str, bytes]]:
    return [
        ("4 MB header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (4 << 20) + b"\r\n\r\n"),
        ("20,000 headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 20_000 + b"\r\n"),
        ("half a request head", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"),
    ]


def send_raw(host: str, port: int, data: bytes, timeout_s: float = 60.0) -> str:
    """What the server did with ``data``: its status line, or how the connection ended."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data)
        except OSError as exc:      # the server may answer and close before it has read it all
            return f"closed while sending ({type(exc).__name__})"
        start = time.monotonic()
        try:
            head = sock.recv(256)
        except OSError as exc:
            return f"{type(exc).__name__}"
        line = head.split(b"\r\n", 1)[0].decode(errors="replace")
        return f"{line or 'closed'} after {time.monotonic() - start:.1f} s"


class HealthProbe(threading.Thread):
    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base, self.worst_s, self.failures = base, 0.0, 0
        self.case = ""                       # what the main thread is sending now
        self.worst_by_case: dict[str, float] = {}
        self.stop_event = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop_event.wait(0.1):
                start = time.monotonic()
                try:
                    client.get(self.base + "/health").raise_for_status()
                except httpx.HTTPError:
                    self.failures += 1
                took = time.monotonic() - start
                self.worst_s = max(self.worst_s, took)
                self.worst_by_case[self.case] = max(self.worst_by_case.get(self.case, 0.0), took)


def ordinary(base: str) -> int:
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
    return r.status_code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("serve_flags", nargs="*")
    args = parser.parse_args()

    deployment = Deployment(Path("/tmp/tandem-hostile-rss.log"), args.serve_flags, {})
    ok = True
    try:
        deployment.wait_ready(600)
        base = deployment.http
        host, port = urlsplit(base).hostname or "127.0.0.1", urlsplit(base).port or 80
        grpc_target = next(line.split(": ", 1)[1].strip() for line in deployment.lines
                           if line.strip().startswith("gRPC"))
        router_pid = processes(deployment.status())["router"]
        for _ in range(5):
            assert ordinary(base) == 200
        rss = [("after warm-up", rss_mib(router_pid))]
        cases, raws = http_cases(), raw_cases()
        answers: dict[str, set[str]] = {}
        probe = HealthProbe(base)
        probe.start()
        channel = grpc.insecure_channel(grpc_target, options=[("grpc.max_send_message_length", 64 << 20)])
        stub = tandem_pb2_grpc.TandemStub(channel)
        for round_index in range(args.rounds):
            for name, path, body in cases:
                probe.case = name
                r = httpx.post(base + path, content=body, timeout=120, headers={"content-type": "application/json"})
                answers.setdefault(name, set()).add(str(r.status_code))
                ok &= 400 <= r.status_code < 500
            for name, data in raws:
                probe.case = name
                answer = send_raw(host, port, data)
                answers.setdefault(name, set()).add(answer.split(" after")[0])
            probe.case = "gRPC 3M prompt token ids"
            try:
                for _ in stub.Generate(tandem_pb2.CompletionRequest(prompt_token_ids=[1] * 3_000_000), timeout=120):
                    pass
                answers.setdefault("gRPC 3M prompt token ids", set()).add("OK")
                ok = False
            except grpc.RpcError as exc:
                answers.setdefault("gRPC 3M prompt token ids", set()).add(exc.code().name)
            rss.append((f"after round {round_index + 1}", rss_mib(router_pid)))
        probe.stop_event.set()
        probe.join()
        time.sleep(args.idle_s)
        rss.append((f"after {args.idle_s:.0f} s idle", rss_mib(router_pid)))
        still = ordinary(base)
        ok &= still == 200
        print(f"router pid {router_pid}; RSS (MiB, anon / shmem):")
        for label, value in rss:
            print(f"  {label:>22}: {value['anon']:8.1f} / {value['shmem']:.1f}" if value else f"  {label}: gone")
        print("answers:")
        for name, seen in answers.items():
            print(f"  {name:>38}: {', '.join(sorted(seen))}  (slowest /health meanwhile: "
                  f"{probe.worst_by_case.get(name, 0) * 1000:.0f} ms)")
        print(f"/health: slowest {probe.worst_s * 1000:.0f} ms, {probe.failures} failed probes")
        print(f"an ordinary request after: {still}")
    finally:
        deployment.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
