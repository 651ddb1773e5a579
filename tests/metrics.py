"""Reading a Prometheus /metrics page in tests (workers, routers, the planner): fetch it, sum one
metric's samples, or take every sample by name and labels."""
from __future__ import annotations

import httpx


def scrape(target: str) -> str:
    """The /metrics page of ``target`` (host:port)."""
    return httpx.get(f"http://{target}/metrics", timeout=10).raise_for_status().text


def metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus text page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {")


def samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page: ``name{labels}`` -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
