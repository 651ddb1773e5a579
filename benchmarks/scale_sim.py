"""The control plane at scale (issue 28, item 2): `tandem serve --engine sim` with many workers.

A script, not a test. It starts `tandem serve --address local --engine sim --sim-profile P
--prefill NP --decode ND` (default profile: the shipped GPU one, so a step is a short sleep and
the router, not the engine, is what is measured), then runs these phases one after the other and
prints one table. Every number is measured in this run (phase 3 runs first, on a fresh router):

1. **latency**: ``--requests`` streamed completions (``--max-tokens`` tokens, ``--concurrency``
   client loops). Client-side TTFT (request sent -> first token chunk) and ITL (gap between
   token chunks as the client reads them: chunks that arrive together read as ~0) percentiles;
   these include the sim's modelled step time, so the router's added
   latency is bounded above by them, not isolated. Router CPU = the router process's
   utime + stime (/proc/PID/stat) after the phase minus before, divided by requests and by
   streamed tokens (SSE chunks with text). The client shares the machine's cores.
2. **ramp**: open-loop request rates from ``--ramp-rates`` (streamed, ``--ramp-max-tokens``
   tokens), ``--ramp-step-s`` each, until a step has errors, a TTFT p50 over
   ``--ramp-ttft-limit-s`` or completes under 90% of its offered rate. "max streamed req/s" is the
   completed requests/s of the last step that passed.
3. **open streams**: for each K in ``--streams``, K streams with ``--hold-max-tokens`` tokens
   are opened and held until every one has its first token (or ``--hold-timeout-s``); the router's
   RSS (anon, MiB) then minus its RSS before the phase, divided by K, is the memory per open
   stream (streams still waiting for a first token are open too, queued at a worker: the table
   says how many had one). The streams are then closed by the client. Failed = a stream that got
   an error or no first token within ``--timeout-s``. A worker runs at most ``--max-num-seqs``
   sequences, and a held stream keeps generating until ``--hold-max-tokens``: for K streams to
   all start, give `-- --max-num-seqs N` with N x decode workers >= K.
4. **scale**: ``--scale A,B,A`` (A = the starting decode count) while ``--scale-streams`` client
   loops send streamed requests: the wall time of each `tandem scale decode N` (it returns when
   the controller has settled), the time of a `tandem status --json` (one controller reconcile
   view), and the streams that failed (``failed_at``: when in the phase each ended and the tokens
   it had by then, beside each change's ``done_at_s``). The loops run in ``--client-procs``
   processes (one Python process cannot read 2,000 SSE streams on a loaded node without its own
   connects and reads timing out). Before each change the script waits (up to
   ``--scale-settle-s``) until the router has at least 95% of the loops' streams open and, before
   a scale-down, until every decode worker runs a stream, so the drained workers hold some (the
   controller drains the emptiest); each change records what it found (``before``).
5. **kills** (``--kills N``, optional): ``--kill-streams`` fixed greedy prompts are answered once
   undisturbed (the reference), then again while N random workers are kill -9'd, spaced
   ``--kill-every-s`` (victims drawn from the workers running when the kills begin: a `tandem
   status` between kills took up to 16 s under load, so the last kills came after the streams had
   ended); every stream must complete with the reference's text. ``--kills-first`` runs this
   phase before the scale phase, at the deployment's starting size.

**Priorities.** Run as root, the script renices the router (every thread) and its client
processes to ``--router-nice`` (default -5): 24 decode workers importing torch at niceness 0
starved both on 2 cores, and the scale phase's failures were connects and reads at the HTTP layer.

    python benchmarks/scale_sim.py [--slowdown 1] [--prefill 2] [--decode 8] [--streams 1000,5000] \
        [--scale 8,32,8] [--kills 0] [-- extra `tandem serve` flags]

Every prompt takes the P/D path (``--local-prefill-max-tokens 0`` unless given after ``--``: on one
CPU node serve would otherwise prefill short prompts at the decode worker). At the start, after
the held streams and after each phase the output records the load average, MemAvailable, the
controller's reconcile tick times (``tandem status``'s ``reconcile``) and the simulated workers'
mean anon RSS.

Everything listens on 127.0.0.1. The deployment is stopped with Ctrl-C (SIGINT) even on errors.
Exit status 0 when no phase had a failed or differing stream.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from soak import REPO_ROOT, Deployment, rss_mib

DEFAULT_PROFILE = REPO_ROOT / "engine" / "sim" / "profiles" / "llama-3.1-8b-h100.json"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def slowed_profile(profile: dict, slowdown: float, prefill_slowdown: float | None = None) -> dict:
    """The profile of the same hardware ``slowdown`` times slower: decode steps longer, prefill
    ``prefill_slowdown`` (default: ``slowdown``) times slower. The step model has one fixed part,
    fitted to the decode rows, so a prefill step still takes at least the slowed ``base_ms``."""
    prefill_slowdown = slowdown if prefill_slowdown is None else prefill_slowdown
    out = json.loads(json.dumps(profile))
    for row in out["decode"]:
        row["step_ms"] *= slowdown
        row["tok_per_s"] = row.get("tok_per_s", 0.0) / slowdown
    for row in out["prefill"]:
        row["tok_per_s"] /= prefill_slowdown
    out["source"] = (f"{profile.get('source', '')} -- decode slowed {slowdown:g}x, prefill {prefill_slowdown:g}x "
                     "for a benchmark (benchmarks/scale_sim.py)")
    return out


def cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds (fields 14 and 15 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine() -> dict:
    """The node's load average (1, 5, 15 min) and available memory, read now."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return {"loadavg": [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]],
            "mem_available_mib": int(meminfo["MemAvailable"].split()[0]) // 1024}


def snapshot(dep: Deployment) -> dict:
    """``machine()``, the controller's reconcile ticks (``tandem status``) and the simulated
    workers' own memory (anon RSS: what each holds apart from shared library pages)."""
    status = dep.status()
    anon = [m["anon"] for w in status["workers"] if (m := rss_mib(w["pid"]))]
    return {**machine(), "reconcile": status.get("reconcile"), "workers": len(status["workers"]),
            "worker_anon_mib_mean": sum(anon) / len(anon) if anon else None}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- one stream ------------------------------------------------------------------------------

@dataclass
class Result:
    ok: bool
    text: str = ""
    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    ended_at: float = 0.0     # time.monotonic() when the stream ended (or failed)


def prompt_ids(i: int, length: int = 64) -> list[int]:
    return [(1000 + 37 * i + 7 * j) % 40000 + 100 for j in range(length)]


async def stream(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, timeout_s: float,
                 first_token: asyncio.Event | None = None, release: asyncio.Event | None = None) -> Result:
    """One streamed completion. With ``release``: signal ``first_token``, then close the stream
    when ``release`` is set (a held stream; it counts as ok)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    result = Result(ok=False)

    async def run() -> None:
        start = last = time.monotonic()
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:160]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    result.ok = True
                    return
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = f"error event: {str(chunk['error'])[:160]}"
                    return
                text = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                now = time.monotonic()
                if result.ttft_s is None:
                    result.ttft_s = now - start
                    if first_token is not None:
                        first_token.set()
                    if release is not None:
                        await release.wait()
                        result.ok = True
                        return
                else:
                    result.itl_s.append(now - last)
                last = now
                result.text += text
                result.num_tokens += 1
            result.error = "stream ended without [DONE]"

    try:
        await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"no end within {timeout_s} s"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:160]
    result.ended_at = time.monotonic()
    if first_token is not None:
        first_token.set()   # a failed stream must not keep the holder waiting
    return result


def client_for(http: str, num_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=num_connections, max_keepalive_connections=num_connections)
    return httpx.AsyncClient(base_url=http, timeout=httpx.Timeout(None, connect=60), limits=limits)


def failure_times(results: list[Result], t0: float, limit: int = 200) -> list[tuple[float, int, str]]:
    """The first ``limit`` failures: (s after ``t0``, tokens received before it, why), by time."""
    bad = sorted((r.ended_at - t0, r.num_tokens, r.error[:60]) for r in results if not r.ok)
    return [(round(t, 1), n, why) for t, n, why in bad[:limit]]


def failures(results: list[Result]) -> dict[str, int]:
    why: dict[str, int] = {}
    for r in results:
        if not r.ok:
            why[r.error[:80]] = why.get(r.error[:80], 0) + 1
    return why


# -- the phases ------------------------------------------------------------------------------

async def phase_latency(http: str, model: str, router_pid: int, args: argparse.Namespace) -> dict:
    results: list[Result] = []
    queue = list(range(args.requests))
    async with client_for(http, args.concurrency + 8) as client:
        async def loop() -> None:
            while queue:
                i = queue.pop()
                results.append(await stream(client, model, prompt_ids(i), args.max_tokens, args.timeout_s))
        cpu0, t0 = cpu_s(router_pid), time.monotonic()
        await asyncio.gather(*(loop() for _ in range(args.concurrency)))
        cpu1, wall = cpu_s(router_pid), time.monotonic() - t0
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    itl = [x for r in results for x in r.itl_s]
    num_tokens = sum(r.num_tokens for r in results)
    return {"requests": len(results), "failed": sum(not r.ok for r in results), "failures": failures(results),
            "wall_s": wall, "ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
            "itl_p50_ms": pct(itl, 0.5) * 1e3, "itl_p99_ms": pct(itl, 0.99) * 1e3, "tokens": num_tokens,
            "router_cpu_s": cpu1 - cpu0, "cpu_ms_per_request": (cpu1 - cpu0) * 1e3 / max(1, len(results)),
            "cpu_us_per_token": (cpu1 - cpu0) * 1e6 / max(1, num_tokens)}


async def phase_ramp(http: str, model: str, router_pid: int, args: argparse.Namespace) -> dict:
    steps, best = [], 0.0
    async with client_for(http, args.ramp_max_inflight) as client:
        for rate in args.ramp_rates:
            tasks: list[asyncio.Task] = []
            cpu0, t0 = cpu_s(router_pid), time.monotonic()
            n = int(rate * args.ramp_step_s)
            for i in range(n):
                delay = t0 + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if sum(not t.done() for t in tasks) >= args.ramp_max_inflight:
                    break     # the router cannot keep up: stop offering
                tasks.append(asyncio.create_task(
                    stream(client, model, prompt_ids(i), args.ramp_max_tokens, args.timeout_s)))
            results = list(await asyncio.gather(*tasks))
            wall, cpu1 = time.monotonic() - t0, cpu_s(router_pid)
            ok = [r for r in results if r.ok]
            ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
            done_rate = len(ok) / wall
            step = {"offered_rps": rate, "sent": len(results), "completed_rps": done_rate,
                    "failed": len(results) - len(ok), "ttft_p50_ms": pct(ttft, 0.5) * 1e3,
                    "ttft_p99_ms": pct(ttft, 0.99) * 1e3, "router_cpu_frac": (cpu1 - cpu0) / wall}
            passed = (step["failed"] == 0 and len(results) == n and pct(ttft, 0.5) <= args.ramp_ttft_limit_s
                      and done_rate >= 0.9 * rate)
            steps.append({**step, "passed": passed})
            print(f"  ramp {rate} req/s: {json.dumps(step)} {'ok' if passed else 'STOP'}", flush=True)
            if not passed:
                break
            best = done_rate
    return {"max_rps": best, "steps": steps}


async def phase_hold(http: str, model: str, router_pid: int, k: int, args: argparse.Namespace) -> dict:
    idle = rss_mib(router_pid)["anon"]
    cpu0 = cpu_s(router_pid)
    release = asyncio.Event()
    events = [asyncio.Event() for _ in range(k)]
    async with client_for(http, k + 8) as client:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(stream(client, model, prompt_ids(i), args.hold_max_tokens, args.timeout_s,
                                            events[i], release)) for i in range(k)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), args.hold_timeout_s)
        except asyncio.TimeoutError:
            pass
        open_s = time.monotonic() - t0
        held = rss_mib(router_pid)["anon"]
        router_cpu_frac = (cpu_s(router_pid) - cpu0) / open_s
        at_hold = machine()
        set_at_rss = [e.is_set() for e in events]   # set on the first token, or on a failure
        release.set()
        results = list(await asyncio.gather(*tasks))
    failed = sum(not r.ok for r in results)
    had_token = sum(was_set and r.ttft_s is not None for was_set, r in zip(set_at_rss, results))
    return {"k": k, "open_at_rss": had_token, "failed": failed, "failures": failures(results),
            "open_s": open_s, "router_cpu_frac": router_cpu_frac, **at_hold, "idle_rss_mib": idle,
            "held_rss_mib": held, "kib_per_stream": (held - idle) * 1024 / k}


def tandem(dep: Deployment, *argv: str, timeout_s: float = 900) -> tuple[float, str]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "deploy.cli", *argv, "--address", dep.ray_address],
                          capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"tandem {' '.join(argv)} failed: {done.stderr[-800:]}")
    return time.monotonic() - t0, done.stdout


async def load_until(http: str, model: str, loops: range, stop: asyncio.Event, max_tokens: int, timeout_s: float,
                     results: list[Result]) -> None:
    """Client loops ``loops`` (of ``loops.step`` in all): each sends prompt j, j + step, ... until ``stop``."""
    async with client_for(http, len(loops) + 8) as client:
        async def loop(j: int) -> None:
            i = j
            while not stop.is_set():
                results.append(await stream(client, model, prompt_ids(i), max_tokens, timeout_s))
                i += loops.step
        await asyncio.gather(*(loop(j) for j in loops))


LOAD_CHILD = "--load-child"


def load_child(spec_json: str) -> None:
    """A client process of the scale phase: runs its loops until its stdin closes, then prints its
    results as one JSON line (``ended_at`` is CLOCK_MONOTONIC, the same clock as the parent's)."""
    spec = json.loads(spec_json)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def main() -> list[Result]:
        stop, results = asyncio.Event(), list[Result]()
        waiter = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        waiter.add_done_callback(lambda _: stop.set())
        await load_until(spec["http"], spec["model"], range(spec["first"], spec["total"], spec["step"]), stop,
                         spec["max_tokens"], spec["timeout_s"], results)
        return results

    print(json.dumps([r.__dict__ for r in asyncio.run(main())]), flush=True)


class LoadProcesses:
    """The scale phase's loops spread over ``n`` client processes (``load_child``)."""

    def __init__(self, http: str, model: str, num_loops: int, n: int, args: argparse.Namespace) -> None:
        nice = args.router_nice if os.geteuid() == 0 else 0
        self.procs = [subprocess.Popen(
            [sys.executable, __file__, LOAD_CHILD, json.dumps({
                "http": http, "model": model, "first": k, "total": num_loops, "step": n,
                "max_tokens": args.scale_max_tokens, "timeout_s": args.timeout_s})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, nice)) for k in range(n)]

    def stop(self, timeout_s: float) -> list[Result]:
        results: list[Result] = []
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.close()
        deadline = time.monotonic() + timeout_s
        try:
            for proc in self.procs:
                assert proc.stdout is not None
                out = proc.stdout.read()      # a child prints its results once its loops have ended
                proc.wait(max(1.0, deadline - time.monotonic()))
                results += [Result(**r) for r in json.loads(out or "[]")]
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return results


def renice_process(pid: int, nice: int) -> int:
    """Set every thread of ``pid`` to ``nice`` (niceness is per thread on Linux; threads it starts
    later inherit it); returns how many were set."""
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            pass
    return len(tids)


def streams_open(http: str) -> float:
    """The router's open streams (``tandem_num_requests_running``: streaming or waiting for a first token)."""
    page = httpx.get(f"{http}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("tandem_num_requests_running ") or line.startswith("tandem_num_requests_running{"))


def settle(dep: Deployment, num_streams: int, shrink: bool, timeout_s: float) -> dict:
    """Wait until the router has >= 95% of ``num_streams`` open and (``shrink``) every running decode
    worker runs a stream; what was found last, with ``settled``."""
    t0, found = time.monotonic(), {}
    while True:
        try:
            status = dep.status()
            running = sorted(w["num_running"] for w in status["workers"]
                             if w["role"] == "decode" and w["state"] == "running")
            found = {"router_open": streams_open(dep.http), "decode_running": sum(running),
                     "decode_running_min": running[0] if running else 0, "decode_workers": len(running),
                     "decode_running_each": running}
            settled = found["router_open"] >= 0.95 * num_streams and (not shrink or found["decode_running_min"] >= 1)
        except (RuntimeError, subprocess.TimeoutExpired, httpx.HTTPError) as exc:
            found, settled = {"error": str(exc)[:200]}, False
        waited = time.monotonic() - t0
        if settled or waited > timeout_s:
            return {**found, "settled": settled, "waited_s": round(waited, 1)}
        time.sleep(2.0)


async def phase_scale(http: str, model: str, dep: Deployment, args: argparse.Namespace) -> dict:
    results: list[Result] = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    procs = LoadProcesses(http, model, args.scale_streams, args.client_procs, args) if args.client_procs else None
    load = None if procs else asyncio.create_task(load_until(
        http, model, range(args.scale_streams), stop, args.scale_max_tokens, args.timeout_s, results))
    changes = []
    try:
        await asyncio.sleep(args.scale_warm_s)
        status_s, text = await asyncio.to_thread(tandem, dep, "status", "--json")
        under_load = {**machine(), "reconcile": json.loads(text).get("reconcile")}
        for before_count, count in zip(args.scale, args.scale[1:]):
            before = await asyncio.to_thread(settle, dep, args.scale_streams, count < before_count,
                                             args.scale_settle_s)
            print(f"  before decode {before_count} -> {count}: {json.dumps(before)}", flush=True)
            started_at = time.monotonic() - t0
            took, _ = await asyncio.to_thread(tandem, dep, "scale", "decode", str(count))
            changes.append({"to": count, "s": took, "started_at_s": started_at, "done_at_s": time.monotonic() - t0,
                            "before": before, **machine()})
            print(f"  scale decode -> {count}: {took:.1f} s", flush=True)
    finally:
        stop.set()
        if procs:
            results += await asyncio.to_thread(procs.stop, args.timeout_s + 30)
        elif load is not None:
            await asyncio.wait_for(load, args.timeout_s + 30)
    return {"changes": changes, "status_s": status_s, "under_load": under_load, "after": snapshot(dep),
            "failed_at": failure_times(results, t0), "requests": len(results),
            "failed": sum(not r.ok for r in results), "failures": failures(results)}


async def phase_kills(http: str, model: str, dep: Deployment, args: argparse.Namespace) -> dict:
    finished = [0]

    async def counted(client: httpx.AsyncClient, i: int) -> Result:
        result = await stream(client, model, prompt_ids(i), args.kill_max_tokens, args.timeout_s)
        finished[0] += 1
        return result

    async def run_all() -> list[Result]:
        async with client_for(http, args.kill_streams + 8) as client:
            return list(await asyncio.gather(*(counted(client, i) for i in range(args.kill_streams))))

    reference = await run_all()
    finished[0] = 0
    if not all(r.ok for r in reference):
        return {"error": f"the undisturbed reference failed: {failures(reference)}"}
    rng = random.Random(args.seed)
    kills: list[str] = []

    # The victims come from one status, read before the streams start: a status between kills took
    # up to 16 s under load, and then the last kills came after every stream had ended.
    status = await asyncio.to_thread(dep.status)
    candidates = [w for w in status["workers"] if w["state"] == "running" and w["pid"]]

    async def killer() -> None:
        for _ in range(args.kills):
            await asyncio.sleep(args.kill_every_s)
            if candidates:
                victim = candidates.pop(rng.randrange(len(candidates)))
                try:
                    os.kill(victim["pid"], signal.SIGKILL)
                    # A kill after every stream ended tests nothing: say how many were in flight.
                    kills.append(f"{victim['id']} ({args.kill_streams - finished[0]} in flight)")
                except ProcessLookupError:
                    kills.append(f"{victim['id']} already gone")

    results, _ = await asyncio.gather(run_all(), killer())
    differing = sum(r.ok and r.text != ref.text for r, ref in zip(results, reference))
    return {"streams": len(results), "workers": len(status["workers"]), "kills": kills,
            "failed": sum(not r.ok for r in results),
            "failures": failures(results), "differing": differing}


# -- main ------------------------------------------------------------------------------------

def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=str(DEFAULT_PROFILE))
    p.add_argument("--slowdown", type=float, default=1.0,
                   help="run the profile this many times slower (every step longer, prefill slower): on a small "
                        "machine the simulated workers' own CPU (scheduler, sampling bookkeeping per step) and the "
                        "token rate of thousands of streams at GPU speed would measure this machine, not the "
                        "control plane; the table's times are wall times of the slowed run")
    p.add_argument("--prefill-slowdown", type=float, default=None,
                   help="run prefill this many times slower (default: --slowdown). A prefill worker's CPU grows "
                        "with the prompts that arrive, not with the steps of running streams, so it can run faster "
                        "than decode: at --slowdown 100 an 8-prompt prefill step takes 2.3 s and 16 workers start "
                        "~55 streams/s, below what the router does")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ramp-rates", type=ints, default=[50, 100, 200, 400, 800, 1600])
    p.add_argument("--ramp-step-s", type=float, default=10.0)
    p.add_argument("--ramp-max-tokens", type=int, default=8)
    p.add_argument("--ramp-max-inflight", type=int, default=4000)
    p.add_argument("--ramp-ttft-limit-s", type=float, default=1.0)
    p.add_argument("--streams", type=ints, default=[1000, 5000])
    p.add_argument("--hold-max-tokens", type=int, default=4000)
    p.add_argument("--hold-timeout-s", type=float, default=300.0)
    p.add_argument("--scale", type=ints, default=[8, 32, 8], help="decode counts; the first is --decode's")
    p.add_argument("--scale-streams", type=int, default=2000)
    p.add_argument("--scale-max-tokens", type=int, default=256)
    p.add_argument("--scale-warm-s", type=float, default=10.0)
    p.add_argument("--scale-settle-s", type=float, default=90.0,
                   help="before each change, wait up to this long for the streams to be open (and, before a "
                        "scale-down, on every decode worker)")
    p.add_argument("--client-procs", type=int, default=4, help="processes the scale phase's loops run in (0: this one)")
    p.add_argument("--router-nice", type=int, default=-5,
                   help="niceness for the router and the client processes (as root; below the workers' 0)")
    p.add_argument("--kills-first", action="store_true", help="run the kills before the scale phase")
    p.add_argument("--kills", type=int, default=0)
    p.add_argument("--kill-streams", type=int, default=500)
    p.add_argument("--kill-max-tokens", type=int, default=1024)
    p.add_argument("--kill-every-s", type=float, default=0.5)
    p.add_argument("--timeout-s", type=float, default=600.0, help="the longest one stream may take")
    p.add_argument("--skip", default="", help="phases to skip, comma-separated: latency,ramp,hold,scale")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("extra", nargs="*", help="after --: extra `tandem serve` flags")
    args = p.parse_args()
    if args.scale and args.scale[0] != args.decode:
        p.error(f"--scale starts at {args.scale[0]} but --decode is {args.decode}: make them equal")
    return args


async def run_phases(dep: Deployment, args: argparse.Namespace) -> dict:
    router_pid = dep.status()["router"]["pid"]
    if os.geteuid() == 0 and args.router_nice:
        print(f"router pid {router_pid}: {renice_process(router_pid, args.router_nice)} threads at niceness "
              f"{args.router_nice}", flush=True)
    async with httpx.AsyncClient(base_url=dep.http, timeout=60) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
    skip = set(args.skip.split(","))
    out: dict = {"start": {**snapshot(dep), "utc": time.strftime("%H:%M:%S", time.gmtime())}}
    print(f"start: {json.dumps(out['start'])}", flush=True)
    # Open streams first: the RSS per stream is a difference, and the allocator keeps what the
    # load of the other phases grew (measured after them, 200 streams read as 0.5 KiB each).
    if "hold" not in skip:
        out["hold"] = []
        for k in args.streams:
            out["hold"].append(await phase_hold(dep.http, model, router_pid, k, args))
            print(f"hold: {json.dumps(out['hold'][-1])}", flush=True)
    if "hold" not in skip:
        out["after_hold"] = snapshot(dep)
        print(f"after hold: {json.dumps(out['after_hold'])}", flush=True)
    if "latency" not in skip:
        out["latency"] = await phase_latency(dep.http, model, router_pid, args)
        out["latency"].update(machine())
        print(f"latency: {json.dumps(out['latency'])}", flush=True)
    if "ramp" not in skip:
        out["ramp"] = await phase_ramp(dep.http, model, router_pid, args)
        out["ramp"].update(machine())
    for phase in ("kills", "scale") if args.kills_first else ("scale", "kills"):
        if phase == "scale" and "scale" not in skip and len(args.scale) > 1:
            out["scale"] = await phase_scale(dep.http, model, dep, args)
            print(f"scale: {json.dumps(out['scale'])}", flush=True)
        elif phase == "kills" and args.kills:
            out["kills"] = await phase_kills(dep.http, model, dep, args)
            out["kills"].update(machine())
            print(f"kills: {json.dumps(out['kills'])}", flush=True)
    out["router_rss_end_mib"] = rss_mib(router_pid)
    out["end"] = {**machine(), "utc": time.strftime("%H:%M:%S", time.gmtime())}
    return out


def print_table(out: dict, args: argparse.Namespace) -> None:
    rows: list[tuple[str, str]] = [("deployment", f"{args.prefill} prefill + {args.decode} decode, "
                                                  f"profile {Path(args.profile).name}")]
    if lat := out.get("latency"):
        rows += [(f"TTFT p50 / p99 ({lat['requests']} streams, {args.concurrency} at once, {args.max_tokens} tok)",
                  f"{lat['ttft_p50_ms']:.1f} / {lat['ttft_p99_ms']:.1f} ms"),
                 ("ITL p50 / p99", f"{lat['itl_p50_ms']:.2f} / {lat['itl_p99_ms']:.2f} ms"),
                 ("router CPU per request / per streamed token",
                  f"{lat['cpu_ms_per_request']:.2f} ms / {lat['cpu_us_per_token']:.1f} us"),
                 ("latency phase failed", str(lat["failed"]))]
    if ramp := out.get("ramp"):
        last = ramp["steps"][-1] if ramp["steps"] else {}
        rows += [(f"max streamed req/s ({args.ramp_max_tokens} tok, passed step)", f"{ramp['max_rps']:.0f}"),
                 ("last ramp step (passed)" if last.get("passed") else "ramp stopped at",
                  f"{last.get('offered_rps')} req/s offered: {last.get('completed_rps', 0):.0f} "
                                     f"done/s, {last.get('failed')} failed, TTFT p50 "
                                     f"{last.get('ttft_p50_ms', 0):.0f} ms")]
    if st := out.get("start"):
        rows.append(("simulated worker anon RSS (mean), MemAvailable at start",
                     f"{st['worker_anon_mib_mean']:.0f} MiB, {st['mem_available_mib']} MiB"))
    for h in out.get("hold", []):
        rows.append((f"{h['k']} open streams: router RSS, per stream, failed",
                     f"{h['idle_rss_mib']:.0f} -> {h['held_rss_mib']:.0f} MiB, {h['kib_per_stream']:.1f} KiB, "
                     f"{h['failed']} ({h['open_at_rss']} had a token when RSS was read, {h['open_s']:.1f} s; "
                     f"router {100 * h['router_cpu_frac']:.0f}% of a core, load {h['loadavg'][0]})"))
    for name in ("start", "after_hold"):
        if (rc := out.get(name, {}).get("reconcile")) and rc.get("ticks"):
            rows.append((f"controller reconcile tick p50 / max ({name}, last {rc['ticks']})",
                         f"{rc['p50_ms']} / {rc['max_ms']} ms"))
    if sc := out.get("scale"):
        steps = " -> ".join([str(args.scale[0])] + [f"{c['to']} ({c['s']:.1f} s)" for c in sc["changes"]])
        rows += [(f"scale decode under {args.scale_streams} streams", steps),
                 ("`tandem status --json` under that load", f"{sc['status_s']:.2f} s"),
                 ("controller reconcile tick p50 / max under that load",
                  f"{(sc['under_load']['reconcile'] or {}).get('p50_ms')} / "
                  f"{(sc['under_load']['reconcile'] or {}).get('max_ms')} ms"),
                 ("scale phase streams / failed", f"{sc['requests']} / {sc['failed']}")]
        for c in sc["changes"]:
            b = c["before"]
            rows.append((f"  before -> {c['to']} (at {c['started_at_s']:.0f} s, done at {c['done_at_s']:.0f} s)",
                         b.get("error") or f"router {b['router_open']:.0f} open, decode running {b['decode_running']} "
                         f"(min {b['decode_running_min']} on {b['decode_workers']}), settled {b['settled']} "
                         f"after {b['waited_s']} s"))
    if k := out.get("kills"):
        rows.append((f"--kills {args.kills} under {args.kill_streams} streams, {k.get('workers')} workers",
                     k.get("error") or f"{k['failed']} failed, {k['differing']} differing; killed {k['kills']}"))
    width = max(len(r[0]) for r in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for phase in ("latency", "scale", "kills"):
        if out.get(phase, {}).get("failures"):
            print(f"{phase} failures by cause: {out[phase]['failures']}")
    for h in out.get("hold", []):
        if h["failures"]:
            print(f"hold {h['k']} failures by cause: {h['failures']}")


def main() -> int:
    if sys.argv[1:2] == [LOAD_CHILD]:
        load_child(sys.argv[2])
        return 0
    args = parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # `timeout` or a kill sends SIGTERM: leave through the finally below, which stops the deployment.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(tempfile.mkdtemp(prefix="tandem-scale-sim-"))
    profile = args.profile
    if args.slowdown != 1.0 or args.prefill_slowdown not in (None, 1.0):
        profile = str(workdir / "slowed.json")
        Path(profile).write_text(json.dumps(slowed_profile(json.loads(Path(args.profile).read_text()),
                                                           args.slowdown, args.prefill_slowdown)))
    # On one CPU node serve prefills prompts up to 4096 tokens at the decode worker (no P/D);
    # the simulated workers model GPU ones, so every prompt takes the P/D path unless asked.
    local = [] if any(f.startswith("--local-prefill-max-tokens") for f in args.extra) else [
        "--local-prefill-max-tokens", "0"]
    flags = ["--engine", "sim", "--sim-profile", profile, "--prefill", str(args.prefill),
             "--decode", str(args.decode), *local, *args.extra]
    log = workdir / "serve.log"
    print(f"tandem serve {' '.join(flags)} (log: {log})", flush=True)
    dep = Deployment(log, flags, {})
    try:
        dep.wait_ready(600)
        out = asyncio.run(run_phases(dep, args))
    finally:
        dep.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print_table(out, args)
    bad = (out.get("latency", {}).get("failed") or any(h["failed"] for h in out.get("hold", []))
           or out.get("scale", {}).get("failed") or out.get("kills", {}).get("failed")
           or out.get("kills", {}).get("differing") or out.get("kills", {}).get("error"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
