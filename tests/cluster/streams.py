"""Greedy completion streams through a router's HTTP API, and worker /metrics, as the cluster
tests read them (runs in the test process, the nodes' bridge reached from here).

A test starts ``Streams`` in the background, breaks a node or a link while they run, and reads
each stream's whole text (or the error the router answered with) at the end.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx


async def _stream(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, seen: list[int],
                  i: int) -> str | dict:
    """The streamed text, or the error the router answered with (a status or an error event)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code, **json.loads(await response.aread())}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return chunk
            text += chunk["choices"][0]["text"]
            seen[i] += 1
    return text


class Streams(threading.Thread):
    """One greedy completion per prompt, all streaming at once in the background."""

    def __init__(self, url: str, prompts: list[list[int]], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.seen = [0] * len(prompts)               # chunks received per stream
        self.result: list[str | dict] | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        async def main() -> list[str | dict]:
            async with httpx.AsyncClient(base_url=self.url, timeout=300) as client:
                model = (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
                return await asyncio.gather(*(_stream(client, model, p, self.max_tokens, self.seen, i)
                                              for i, p in enumerate(self.prompts)))
        try:
            self.result = asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported by join_result
            self.error = exc

    def wait_until_streaming(self, timeout_s: float = 60) -> None:
        """Until every stream has had a chunk (the router coalesces a fast stream's tokens, so a
        stream may be a few chunks in all)."""
        deadline = time.monotonic() + timeout_s
        while min(self.seen) < 1:
            assert self.error is None and self.is_alive(), f"streams ended early: {self.error!r} {self.result}"
            assert time.monotonic() < deadline, f"streams did not start: {self.seen}"
            time.sleep(0.01)

    def outcomes(self, timeout_s: float = 300) -> list[str | dict]:
        """Each stream's text or error, once all ended (a stream still open after ``timeout_s`` hung)."""
        self.join(timeout_s)
        assert not self.is_alive(), f"streams still running after {timeout_s} s: {self.seen}"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def join_result(self, timeout_s: float = 300) -> list[str]:
        """Each stream's text; fails on any error."""
        outcomes = self.outcomes(timeout_s)
        errors = [o for o in outcomes if isinstance(o, dict)]
        assert not errors, errors
        return outcomes
