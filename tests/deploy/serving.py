"""Drive a real `tandem serve` from tests: start one on ephemeral ports and read its addresses,
stream chat completions against it (in the background while a test scales or kills workers),
wait for a condition, Ctrl-C it, and check that nothing it started is left."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from deploy.launch import REPO_ROOT

MODEL = "smollm2-135m-instruct"
SERVE_TIMEOUT_S = 300


@dataclass
class Deployment:
    proc: subprocess.Popen
    log: Path
    lines: list[str] = field(default_factory=list)
    http: str = ""
    grpc: str = ""
    ray_address: str = ""

    def cli(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "deploy.cli", *args, "--address", self.ray_address],
                              capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT)
        assert done.returncode == 0, f"tandem {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
        return done

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").stdout)

    def log_tail(self) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-60:])


def start_serve(tmp_path: Path, *flags: str) -> Deployment:
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--address", "local", "--http-port", "0",
                             "--grpc-port", "0", *flags], stdout=subprocess.PIPE, stderr=open(log, "wb"),
                            text=True, cwd=REPO_ROOT, start_new_session=True)
    dep = Deployment(proc, log)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while not any(line.startswith("  Ray cluster:") for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            interrupt(proc)
            pytest.fail(f"tandem serve did not come up (exit {proc.poll()}):\n{''.join(lines)}\n{dep.log_tail()}")
        time.sleep(0.2)
    dep.lines = lines
    for line in lines:
        key, _, value = line.strip().partition(": ")
        if key == "OpenAI HTTP":
            dep.http = value.removesuffix("/v1")
        elif key == "gRPC":
            dep.grpc = value.strip()
        elif key == "Ray cluster":
            dep.ray_address = value.strip()
    return dep


def assert_nothing_left(pids: list[int]) -> None:
    for pid in pids:
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"process {pid} ({Path(f'/proc/{pid}/cmdline').read_bytes()[:80]!r}) is still running")
        assert not list(Path("/dev/shm").glob(f"tandem-kv-{pid}-*")), f"KV pool of pid {pid} left in /dev/shm"


def all_pids(status: dict) -> list[int]:
    return [status["router"]["pid"], *(p for w in status["workers"] for p in w["pids"])]


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    text, usage, finish = "", None, None
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return {"text": text, "finish_reason": finish, "completion_tokens": usage["completion_tokens"]}


def run_streams(http: str, prompts: list[str], max_tokens: int) -> list[dict]:
    async def main():
        async with httpx.AsyncClient(base_url=http, timeout=600) as client:
            return await asyncio.gather(*(_stream(client, p, max_tokens) for p in prompts))
    return asyncio.run(main())


class Streams(threading.Thread):
    """Streams running in the background while the test scales or kills workers."""

    def __init__(self, http: str, prompts: list[str], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.args, self.result, self.error = (http, prompts, max_tokens), None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = run_streams(*self.args)
        except BaseException as exc:  # noqa: BLE001 - reported by join_result
            self.error = exc

    def join_result(self, timeout_s: float = 300) -> list[dict]:
        self.join(timeout_s)
        assert not self.is_alive(), "streams did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def wait_for(predicate, what: str, timeout_s: float = 120.0, dep: Deployment | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"{what} did not happen within {timeout_s:.0f} s" + (f"\n{dep.log_tail()}" if dep else ""))


def interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C for a `tandem serve` that is still running (it stops what it started)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def completions(http: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    with httpx.Client(base_url=http, timeout=300) as client:
        out = []
        for prompt in prompts:
            r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
        return out
