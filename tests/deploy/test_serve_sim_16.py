"""Sixteen simulated workers behind the real router (`tandem serve --engine sim`, 4 prefill +
12 decode processes under Ray and the controller): while 96 streams run, two decode workers are
kill -9'd and the decode role is scaled from 12 to 8; every stream completes with the tokens an
undisturbed run gives (the simulated engine's tokens are a hash of prompt and position, so the
undisturbed run is known without running it), and Ctrl-C leaves nothing behind."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from deploy.launch import REPO_ROOT
from engine.sim.tokens import next_token, prompt_digest
from engine.tokenizer import Tokenizer
from tests.deploy.serving import all_pids, assert_nothing_left, interrupt, start_serve, wait_for
from tests.engine.sim.profiles import profile_rows

pytestmark = pytest.mark.slow
NUM_STREAMS = 96
MAX_TOKENS = 120
PROMPTS = [list(range(300 + 3 * i, 340 + 5 * i)) for i in range(NUM_STREAMS)]


async def _completion(client: httpx.AsyncClient, model: str, prompt: list[int]) -> tuple[str, str | None]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, finish = "", None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {(await response.aread())[:200]!r}", None
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return f"error: {chunk['error']}", None
                for choice in chunk["choices"]:
                    text += choice.get("text") or ""
                    finish = choice.get("finish_reason") or finish
    return text, finish


def test_16_simulated_workers_lose_no_stream_to_kills_and_a_scale_down(tmp_path):
    # ~45 ms decode steps at these batches: a stream of 120 tokens lives ~5 s, long enough for
    # both kills and the scale-down to land while streams run.
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps(profile_rows(40.0, 0.2, 0.002, 20000.0, kv_cache_tokens=8192)))
    dep = start_serve(tmp_path / "serve", "--engine", "sim", "--sim-profile", str(profile), "--prefill", "4",
                      "--decode", "12", "--max-model-len", "1024", "--local-prefill-max-tokens", "0")
    pids: list[int] = []
    try:
        status = dep.status()
        pids = all_pids(status)
        roles = [w["role"] for w in status["workers"]]
        assert (roles.count("prefill"), roles.count("decode")) == (4, 12)
        results: list = []

        async def streams() -> None:
            limits = httpx.Limits(max_connections=NUM_STREAMS + 8)
            async with httpx.AsyncClient(base_url=dep.http, timeout=300, limits=limits) as client:
                model = (await client.get("/v1/models")).json()["data"][0]["id"]
                results.extend(await asyncio.gather(*(_completion(client, model, p) for p in PROMPTS)))
        runner = threading.Thread(target=lambda: asyncio.run(streams()), daemon=True)
        runner.start()

        killed: list[str] = []
        for _ in range(2):
            victim = wait_for(lambda: next((w for w in dep.status()["workers"] if w["role"] == "decode"
                                            and w["state"] == "running" and w["num_running"] >= 2
                                            and w["id"] not in killed), None),
                              "a decode worker with streams on it", dep=dep)
            os.kill(victim["pid"], signal.SIGKILL)
            killed.append(victim["id"])
            time.sleep(0.5)
        dep.cli("scale", "decode", "8")
        decodes = [w for w in dep.status()["workers"] if w["role"] == "decode"]
        assert len(decodes) == 8
        # More than this 2-CPU cluster can ever place (44 x 0.1 CPU + the router's 0.1): refused at
        # once with the numbers, not left to wait --start-timeout-s for resources.
        refused = subprocess.run([sys.executable, "-m", "deploy.cli", "scale", "decode", "40", "--address",
                                  dep.ray_address], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        want = ("4 prefill + 40 decode workers (44 ranks) at 0.1 CPU each (--cpus-per-worker) and the router's "
                "0.1 need 4.5 CPUs")
        assert refused.returncode != 0 and want in refused.stderr, refused.stderr
        assert dep.status()["desired"] == {"prefill": 4, "decode": 8}
        runner.join(240)
        assert not runner.is_alive(), "streams did not finish"
        assert len(results) == NUM_STREAMS

        tokenizer = Tokenizer.from_model("smollm2-135m-instruct")
        wrong = []
        for i, (prompt, (text, finish)) in enumerate(zip(PROMPTS, results)):
            digest = prompt_digest(prompt)
            want = tokenizer.decode([next_token(digest, len(prompt) + k, tokenizer.vocab_size)
                                     for k in range(MAX_TOKENS)])
            if (text, finish) != (want, "length"):
                wrong.append((i, finish, text[:80]))
        assert not wrong, f"{len(wrong)} of {NUM_STREAMS} streams differ from the undisturbed run: {wrong[:5]}"
        pids = all_pids(dep.status()) + pids
    finally:
        interrupt(dep.proc)
    assert dep.proc.returncode == 0, dep.log_tail()
    assert_nothing_left(sorted(set(pids)))
