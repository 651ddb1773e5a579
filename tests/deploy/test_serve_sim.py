"""`tandem serve --engine sim` for real: Ray, the controller, the router and 2 + 2 simulated worker
processes; streams through the router's HTTP API equal the tokens the simulated engine gives
(a hash of prompt and position), and Ctrl-C leaves nothing behind."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.sim.tokens import next_token, prompt_digest
from engine.tokenizer import Tokenizer
from tests.deploy.serving import all_pids, assert_nothing_left, interrupt, start_serve
from tests.engine.sim.profiles import write_fast_profile

pytestmark = pytest.mark.slow
PROMPTS = [list(range(200 + i, 260 + 7 * i)) for i in range(8)]
MAX_TOKENS = 12


async def _completion(client: httpx.AsyncClient, model: str, prompt: list[int]) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(c.get("text") or "" for c in chunk["choices"])
    return text


def test_serve_sim_streams_through_the_router(tmp_path):
    profile = write_fast_profile(tmp_path / "fast.json")
    dep = start_serve(tmp_path / "serve", "--engine", "sim", "--sim-profile", str(profile), "--prefill", "2",
                      "--decode", "2", "--max-model-len", "1024", "--local-prefill-max-tokens", "0")
    pids: list[int] = []
    try:
        status = dep.status()
        pids = all_pids(status)
        assert sorted(w["role"] for w in status["workers"]) == ["decode", "decode", "prefill", "prefill"]

        async def run() -> tuple[str, list[str]]:
            async with httpx.AsyncClient(base_url=dep.http, timeout=60) as client:
                model = (await client.get("/v1/models")).json()["data"][0]["id"]
                return model, await asyncio.gather(*(_completion(client, model, p) for p in PROMPTS))

        model, texts = asyncio.run(run())
        assert model == f"sim:{profile}"
        tokenizer = Tokenizer.from_model("smollm2-135m-instruct")
        for prompt, text in zip(PROMPTS, texts):
            digest = prompt_digest(prompt)
            ids = [next_token(digest, len(prompt) + i, tokenizer.vocab_size) for i in range(MAX_TOKENS)]
            assert text == tokenizer.decode(ids)
    finally:
        interrupt(dep.proc)
    assert dep.proc.returncode == 0, dep.log_tail()
    assert_nothing_left(pids)
