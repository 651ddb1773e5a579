"""Chaos soak: `tandem serve` under sustained mixed load while workers, KV transfers and the router fail.

A script, not a timed test (tests/deploy/test_soak.py runs a short version in CI). Two
deployments of `tandem serve --address local` run one after the other on this machine:

1. **reference**: undisturbed. Every greedy request of the workload is answered once; its text
   is what the chaos run must reproduce. Seeded sampled requests (n = 2) are answered too and
   compared for information only: a sampled token can flip on a float rounding that depends on
   what the prefix cache held (the prompt computed whole, or only its tail), which no
   engine that is not batch-invariant promises.
2. **chaos**: the same deployment with ``TANDEM_KV_FAULT_RATE`` set in its environment (each KV
   write of a prefill worker fails with that probability: kvtransfer/faults.py), under
   ``--concurrency`` client loops for ``--duration-s``, while a chaos thread kill -9s a random
   worker process every ``--kill-every-s`` (the controller restarts it) and kill -9s the router
   once, half-way (the controller restarts it on the same ports).

The workload (seeded): completions and chat requests with prompts of 10 to ~900 tokens, streamed
and not, ``n`` = 2 with a seed, top-5 logprobs, JSON-schema constrained output, and clients that
cancel a stream after its first chunks or give up on a request before it ends.

Each request ends as one of: **completed** (a finish_reason, and ``[DONE]`` when streamed),
**cancelled** (by the client, on purpose), **failed** with a retriable error the client can act
on (HTTP 429/503, an error event, a connection refused or cut while the router restarted),
**failed (other)** (any other error: a defect) or **lost** (no answer within
``--request-timeout-s``, a stream that ends without ``[DONE]`` and without an error, a 200 with a
missing finish_reason). Completed greedy requests whose text differs from the reference are
**differing**. After the load: every worker must reach 0 running, 0 waiting and 0 KV blocks in
use (``tandem_kv_cache_usage_ratio`` x ``tandem_kv_cache_blocks_total`` on its /metrics), and the
RSS of the router and of each worker (by replica; a killed one is a new process) is printed at
start and end.

    python benchmarks/soak.py [--duration-s 600] [--concurrency 6] [--kill-every-s 30] \
        [--kv-fault-rate 0.02] [--json out.json] [-- extra `tandem serve` flags]

Defaults: 2 prefill + 2 decode workers, float32 (a resumed request recomputes its generated
tokens' KV in one prefill; bf16 would round that differently from the decode steps, see
tests/deploy/test_serve_e2e.py), ``--local-prefill-max-tokens 0`` (every prompt goes P/D, so KV
transfers happen). Exit status 0 when nothing was lost, nothing differed, no block leaked and
nothing failed with a non-retriable error.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path: put the repository root there.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO_ROOT)

from kvtransfer.faults import FAULT_RATE_ENV, FAULT_SEED_ENV  # noqa: E402

RETRIABLE_STATUSES = (429, 502, 503)
WORDS = ("the river carried small boats past the old mill while children counted clouds and merchants "
         "argued about the price of salt wool copper lamps maps and the weather over distant hills").split()
JSON_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                  "population": {"type": "integer"}},
               "required": ["city", "population"], "additionalProperties": False}


# -- the workload ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    """One request of the workload. ``deterministic``: its text must equal the reference's."""
    key: str
    path: str            # /v1/completions or /v1/chat/completions
    body: dict
    stream: bool
    deterministic: bool  # greedy: the text must equal the reference's
    seeded: bool = False  # sampled with a seed: compared, but reported apart (see summarize)


def make_items(seed: int) -> list[Item]:
    rng = random.Random(seed)

    def text(num_words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(num_words))

    items: list[Item] = []
    lengths = [8, 24, 60, 150, 300, 600]          # words; ~1.3 tokens each
    for i, num_words in enumerate(lengths * 3):
        prompt = f"Story {i}: {text(num_words)}. Continue:"
        max_tokens = rng.choice([8, 24, 48])
        kind = i % 6
        if kind == 0:
            items.append(Item(f"c{i}-stream", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                                   "temperature": 0}, True, True))
        elif kind == 1:
            items.append(Item(f"c{i}-logprobs", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                                     "temperature": 0, "logprobs": 5}, False, True))
        elif kind == 2:
            items.append(Item(f"c{i}-n2", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "n": 2,
                                                               "temperature": 0.8, "seed": 1000 + i}, True, False,
                              seeded=True))
        elif kind == 3:
            items.append(Item(f"chat{i}", "/v1/chat/completions", {
                "messages": [{"role": "system", "content": "You answer briefly."},
                             {"role": "user", "content": f"Summarise: {text(num_words)}"}],
                "max_tokens": max_tokens, "temperature": 0}, True, True))
        elif kind == 4:
            items.append(Item(f"json{i}", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"Name a city near: {text(min(num_words, 60))}"}],
                "max_tokens": 48, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": JSON_SCHEMA}}},
                False, True))
        else:
            items.append(Item(f"c{i}-sampled", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                                    "temperature": 1.0}, True, False))
    return items


# -- one request -------------------------------------------------------------------------------

@dataclass
class Outcome:
    key: str
    kind: str                 # completed | cancelled | failed | failed_other | lost
    detail: str = ""
    texts: list[str] = field(default_factory=list)   # per choice, when completed


async def send(client: httpx.AsyncClient, item: Item, timeout_s: float, cancel_after: int | None = None,
               give_up_s: float | None = None) -> Outcome:
    """One request. ``cancel_after``: close the stream after that many events; ``give_up_s``: the
    client abandons a non-streamed request after that long (both count as cancelled)."""
    body = {**item.body, "stream": item.stream}
    try:
        if item.stream:
            coro = _stream(client, item, body, cancel_after)
        else:
            coro = _unary(client, item, body)
        if give_up_s is not None:
            try:
                return await asyncio.wait_for(coro, give_up_s)
            except asyncio.TimeoutError:
                return Outcome(item.key, "cancelled", "client gave up")
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:
        return Outcome(item.key, "lost", f"no answer within {timeout_s} s")
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        return Outcome(item.key, "failed", f"connection: {type(exc).__name__}")


async def _unary(client: httpx.AsyncClient, item: Item, body: dict) -> Outcome:
    response = await client.post(item.path, json=body)
    if response.status_code != 200:
        return _error_outcome(item, response.status_code, response.text)
    data = response.json()
    choices = sorted(data.get("choices", []), key=lambda c: c["index"])
    if not choices or any(c.get("finish_reason") is None for c in choices):
        return Outcome(item.key, "lost", f"200 without a finish_reason: {response.text[:200]}")
    texts = [c["text"] if "text" in c else (c["message"].get("content") or "") for c in choices]
    if "response_format" in body and choices[0]["finish_reason"] == "stop":
        try:
            json.loads(texts[0])
        except ValueError:
            return Outcome(item.key, "failed_other", f"constrained output is not JSON: {texts[0][:200]!r}")
    return Outcome(item.key, "completed", texts=texts)


async def _stream(client: httpx.AsyncClient, item: Item, body: dict, cancel_after: int | None) -> Outcome:
    n = body.get("n", 1)
    texts, finished, events = [""] * n, [False] * n, 0
    async with client.stream("POST", item.path, json=body) as response:
        if response.status_code != 200:
            return _error_outcome(item, response.status_code, (await response.aread()).decode(errors="replace"))
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                if not all(finished):
                    return Outcome(item.key, "lost", "[DONE] before every choice finished")
                return Outcome(item.key, "completed", texts=texts)
            event = json.loads(data)
            if "error" in event:
                return _error_outcome(item, 200, data)
            for choice in event.get("choices", []):
                i = choice["index"]
                texts[i] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                finished[i] = finished[i] or choice.get("finish_reason") is not None
            events += 1
            if cancel_after is not None and events >= cancel_after:
                return Outcome(item.key, "cancelled", "client closed the stream")
    return Outcome(item.key, "lost", "the stream ended without [DONE] or an error")


def _error_outcome(item: Item, status: int, text: str) -> Outcome:
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": text[:200], "type": ""}
    retriable = status in RETRIABLE_STATUSES or error.get("type") in ("service_unavailable", "rate_limit_error")
    return Outcome(item.key, "failed" if retriable else "failed_other",
                   f"{status} {error.get('type')}: {str(error.get('message'))[:160]}")


# -- the deployment ----------------------------------------------------------------------------

class Deployment:
    """A foreground `tandem serve --address local`, stopped with Ctrl-C."""

    def __init__(self, log_path: Path, flags: list[str], env: dict[str, str]) -> None:
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", "--address", "local", "--http-port", "0",
             "--grpc-port", "0", *flags], stdout=subprocess.PIPE, stderr=open(log_path, "wb"), text=True,
            cwd=REPO_ROOT, start_new_session=True, env={**os.environ, **env})
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()
        self.http = self.ray_address = ""

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(line.startswith("  Ray cluster:") for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"tandem serve did not come up:\n{''.join(self.lines)}\n{tail}")
            time.sleep(0.2)
        for line in self.lines:
            key, _, value = line.strip().partition(": ")
            if key == "OpenAI HTTP":
                self.http = value.removesuffix("/v1")
            elif key == "Ray cluster":
                self.ray_address = value.strip()

    def status(self) -> dict:
        done = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--json", "--address", self.ray_address],
                              capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"tandem status failed: {done.stderr[-500:]}")
        return json.loads(done.stdout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def rss_mib(pid: int | None) -> dict[str, float] | None:
    """A process's resident memory in MiB: ``anon`` (its own heap: what a leak grows) and
    ``shmem`` (pages of shared memory it touched: a worker's KV pool, and for a prefill worker the
    decode workers' pools it wrote into over shm)."""
    if not pid:
        return None
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except (OSError, ValueError):
        return None
    return {"anon": int(fields["RssAnon"].split()[0]) / 1024, "shmem": int(fields["RssShmem"].split()[0]) / 1024}


def processes(status: dict) -> dict[str, int | None]:
    """Replica id (or "router") -> its pid."""
    out = {"router": status["router"].get("pid")}
    out.update({w["id"]: w["pid"] for w in status["workers"]})
    return out


def worker_metrics(targets_file: Path) -> dict[str, dict[str, float]]:
    """Per worker: running, waiting and KV blocks in use, read from its own /metrics (found in the
    deployment's Prometheus file_sd targets, --prometheus-sd-file)."""
    out = {}
    for group in json.loads(targets_file.read_text()):
        replica = group["labels"].get("replica", "")
        if replica == "router":
            continue
        try:
            text = httpx.get(f"http://{group['targets'][0]}/metrics", timeout=5).text
        except httpx.HTTPError as exc:
            out[replica] = {"error": str(exc)}
            continue
        values: dict[str, float] = {}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in ("tandem_num_requests_running", "tandem_num_requests_waiting", "tandem_kv_cache_usage_ratio",
                        "tandem_kv_cache_blocks_total", "tandem_kv_transfer_failures_total"):
                values[name] = float(line.rsplit(" ", 1)[1])
        values["kv_blocks_used"] = round(values.get("tandem_kv_cache_usage_ratio", 0)
                                         * values.get("tandem_kv_cache_blocks_total", 0))
        out[replica] = values
    return out


# -- the runs ----------------------------------------------------------------------------------

async def reference(http: str, items: list[Item], timeout_s: float) -> dict[str, list[str]]:
    async with httpx.AsyncClient(base_url=http, timeout=None) as client:
        sem = asyncio.Semaphore(4)

        async def one(item: Item) -> Outcome:
            async with sem:
                return await send(client, item, timeout_s)
        outcomes = await asyncio.gather(*(one(i) for i in items if i.deterministic or i.seeded))
    bad = [o for o in outcomes if o.kind != "completed"]
    if bad:
        raise RuntimeError(f"the undisturbed reference run failed: {[(o.key, o.kind, o.detail) for o in bad[:5]]}")
    return {o.key: o.texts for o in outcomes}


async def load(http: str, items: list[Item], args: argparse.Namespace, stop_at: float,
               rng: random.Random) -> list[Outcome]:
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=http, timeout=None, limits=limits) as client:
        async def loop() -> None:
            while time.monotonic() < stop_at:
                item = rng.choice(items)
                draw = rng.random()
                cancel_after = rng.randint(1, 4) if item.stream and draw < args.cancel_fraction else None
                give_up = rng.uniform(0.2, 2.0) if not item.stream and draw < args.cancel_fraction else None
                outcome = await send(client, item, args.request_timeout_s, cancel_after, give_up)
                outcomes.append(outcome)
                if outcome.kind == "failed":
                    # The router restarting (connection refused) or without a worker of a role
                    # for now (503, Retry-After: 1): back off as a client would.
                    await asyncio.sleep(1.0)
        await asyncio.gather(*(loop() for _ in range(args.concurrency)))
    return outcomes


class Chaos(threading.Thread):
    """kill -9 of a random worker every ``kill_every_s``, and of the router once, half-way."""

    def __init__(self, dep: Deployment, kill_every_s: float, router_at_s: float | None, stop_at: float,
                 rng: random.Random) -> None:
        super().__init__(name="soak-chaos", daemon=True)
        self.dep, self.kill_every_s, self.router_at_s, self.stop_at, self.rng = \
            dep, kill_every_s, router_at_s, stop_at, rng
        self.events: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        next_kill = start + self.kill_every_s
        router_at = start + self.router_at_s if self.router_at_s is not None else None
        while not self._halt.wait(0.5) and time.monotonic() < self.stop_at - 5:
            now = time.monotonic()
            try:
                if router_at is not None and now >= router_at:
                    router_at = None
                    self._kill("router", self.dep.status()["router"].get("pid"), now - start)
                elif self.kill_every_s > 0 and now >= next_kill:
                    next_kill = now + self.kill_every_s
                    running = [w for w in self.dep.status()["workers"] if w["state"] == "running" and w["pid"]]
                    if running:
                        victim = self.rng.choice(running)
                        self._kill(victim["id"], victim["pid"], now - start)
            except Exception as exc:  # noqa: BLE001 - a status call during a restart may fail; try next tick
                self.events.append(f"chaos tick failed: {exc}")

    def _kill(self, name: str, pid: int | None, at_s: float) -> None:
        if not pid:
            self.events.append(f"{at_s:6.1f} s: {name} has no pid (restarting)")
            return
        try:
            os.kill(pid, signal.SIGKILL)
            self.events.append(f"{at_s:6.1f} s: kill -9 {name} (pid {pid})")
        except ProcessLookupError:
            self.events.append(f"{at_s:6.1f} s: {name} (pid {pid}) was already gone")

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def settle(dep: Deployment, targets_file: Path, timeout_s: float) -> tuple[dict, dict]:
    """Wait until every replica runs again and every worker is idle with no KV block in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = dep.status()
        metrics = worker_metrics(targets_file)
        busy = [w for w, m in metrics.items() if m.get("error") or m.get("tandem_num_requests_running", 0)
                or m.get("tandem_num_requests_waiting", 0) or m.get("kv_blocks_used", 0)]
        settled = (all(w["state"] == "running" for w in status["workers"])
                   and status["router"].get("state", "running") == "running" and not busy)
        if settled or time.monotonic() > deadline:
            return status, metrics
        time.sleep(2)


def summarize(outcomes: list[Outcome], ref: dict[str, list[str]], items: dict[str, Item]) -> dict:
    counts = {k: 0 for k in ("completed", "cancelled", "failed", "failed_other", "lost")}
    differing, compared, seeded_compared, seeded_differing, examples = 0, 0, 0, 0, []
    for o in outcomes:
        counts[o.kind] += 1
        if o.kind == "completed" and items[o.key].deterministic:
            compared += 1
            if o.texts != ref[o.key]:
                differing += 1
                examples.append({"key": o.key, "got": o.texts, "want": ref[o.key]})
        elif o.kind == "completed" and items[o.key].seeded:
            seeded_compared += 1
            seeded_differing += o.texts != ref[o.key]
        elif o.kind in ("failed_other", "lost"):
            examples.append({"key": o.key, "kind": o.kind, "detail": o.detail})
    failed_why: dict[str, int] = {}
    for o in outcomes:
        if o.kind == "failed":
            why = re.sub(r"request_id=\S+", "request_id=...", o.detail)[:120]
            failed_why[why] = failed_why.get(why, 0) + 1
    return {"sent": len(outcomes), **counts, "failed_by_cause": failed_why, "compared": compared,
            "differing": differing, "seeded_compared": seeded_compared, "seeded_differing": seeded_differing,
            "examples": examples[:10]}


def run(args: argparse.Namespace) -> dict:
    items = make_items(args.seed)
    by_key = {i.key: i for i in items}
    flags = ["--prefill", str(args.prefill), "--decode", str(args.decode), "--dtype", args.dtype,
             "--local-prefill-max-tokens", "0", *args.serve_flags]
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    dep = Deployment(log_dir / "reference.log", flags, {})
    try:
        dep.wait_ready(args.start_timeout_s)
        t0 = time.monotonic()
        ref = asyncio.run(reference(dep.http, items, args.request_timeout_s))
        print(f"reference: {len(ref)} greedy and seeded requests answered undisturbed in "
              f"{time.monotonic() - t0:.0f} s", flush=True)
    finally:
        dep.stop()

    targets = log_dir / "targets.json"
    flags += ["--prometheus-sd-file", str(targets)]
    env = {FAULT_RATE_ENV: str(args.kv_fault_rate), FAULT_SEED_ENV: str(args.seed)} if args.kv_fault_rate else {}
    dep = Deployment(log_dir / "chaos.log", flags, env)
    try:
        dep.wait_ready(args.start_timeout_s)
        status = dep.status()
        pids_start = processes(status)
        rss_start = {name: rss_mib(pid) for name, pid in pids_start.items()}
        rng = random.Random(args.seed)
        stop_at = time.monotonic() + args.duration_s
        chaos = Chaos(dep, args.kill_every_s, args.duration_s / 2 if args.router_restart else None, stop_at,
                      random.Random(args.seed + 1))
        chaos.start()
        t0 = time.monotonic()
        outcomes = asyncio.run(load(dep.http, items, args, stop_at, rng))
        load_s = time.monotonic() - t0
        chaos.stop()
        status, metrics = settle(dep, targets, args.settle_timeout_s)
        pids_end = processes(status)
        rss_end = {name: rss_mib(pid) for name, pid in pids_end.items()}
    finally:
        dep.stop()
    summary = summarize(outcomes, ref, by_key)
    leaked = {w: m.get("kv_blocks_used") for w, m in metrics.items() if m.get("kv_blocks_used")}
    busy = {w: m for w, m in metrics.items() if m.get("tandem_num_requests_running") or
            m.get("tandem_num_requests_waiting") or m.get("error")}
    return {"duration_s": round(load_s, 1), "concurrency": args.concurrency, "kv_fault_rate": args.kv_fault_rate,
            "kill_every_s": args.kill_every_s, "router_restart": args.router_restart, **summary,
            "chaos": chaos.events, "kv_blocks_leaked": leaked, "busy_after": busy,
            "kv_transfer_failures": {w: m.get("tandem_kv_transfer_failures_total") for w, m in metrics.items()},
            "rss_mib": {name: {"start_pid": pids_start.get(name), "start": rss_start.get(name),
                               "end_pid": pids_end.get(name), "end": rss_end.get(name)}
                        for name in sorted(set(pids_start) | set(pids_end))},
            "restarts": {w["id"]: w["restarts"] for w in status["workers"]}}


def print_report(r: dict) -> None:
    print(f"\nchaos soak: {r['duration_s']} s, {r['concurrency']} client loops, KV fault rate {r['kv_fault_rate']}, "
          f"kill -9 of a worker every {r['kill_every_s']} s, router restart: {r['router_restart']}")
    print("| sent | completed | cancelled (client) | failed, retriable | failed, other | lost | compared | differing |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {r['sent']} | {r['completed']} | {r['cancelled']} | {r['failed']} | {r['failed_other']} | {r['lost']} "
          f"| {r['compared']} | {r['differing']} |")
    print(f"seeded sampled requests (n=2): {r['seeded_differing']} of {r['seeded_compared']} differ from the "
          "reference (informational: a sampled token can flip on float rounding that depends on what the "
          "prefix cache held, as in any engine that is not batch-invariant)")
    print("retriable failures by cause:")
    for why, count in sorted(r["failed_by_cause"].items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d}  {why}")
    print(f"KV blocks in use after the load: {r['kv_blocks_leaked'] or 0}; busy after: {r['busy_after'] or 'none'}")
    print(f"KV transfer failures counted by the workers: {r['kv_transfer_failures']}")
    print(f"worker restarts: {r['restarts']}")
    print("RSS (MiB), anonymous + shared memory, start -> end:")
    for name, v in r["rss_mib"].items():
        def fmt(m: dict | None) -> str:
            return f"{m['anon']:.0f} + {m['shmem']:.0f}" if m else "-"
        same = "same process" if v["start_pid"] == v["end_pid"] else f"pid {v['start_pid']} -> {v['end_pid']}"
        print(f"  {name:12s} {fmt(v['start']):>12s} -> {fmt(v['end']):>12s}  ({same})")
    print("chaos events:")
    for event in r["chaos"]:
        print(f"  {event}")
    for example in r["examples"]:
        print(f"  ! {example}")


def ok(r: dict) -> bool:
    return not (r["lost"] or r["differing"] or r["failed_other"] or r["kv_blocks_leaked"] or r["busy_after"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=600)
    p.add_argument("--concurrency", type=int, default=6, help="client loops, each one request at a time")
    p.add_argument("--kill-every-s", type=float, default=30, help="kill -9 a random worker this often (0: never)")
    p.add_argument("--no-router-restart", dest="router_restart", action="store_false",
                   help="do not kill -9 the router half-way")
    p.add_argument("--kv-fault-rate", type=float, default=0.02, help="probability that one KV write fails (0: off)")
    p.add_argument("--cancel-fraction", type=float, default=0.1,
                   help="requests whose client cancels the stream or gives up early")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=180)
    p.add_argument("--start-timeout-s", type=float, default=300)
    p.add_argument("--settle-timeout-s", type=float, default=120)
    p.add_argument("--log-dir", default="/tmp/tandem-soak")
    p.add_argument("--json", default="", help="also write the result here")
    p.add_argument("serve_flags", nargs="*", help="after --: extra `tandem serve` flags")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if ok(result) else 1


if __name__ == "__main__":
    sys.exit(main())
