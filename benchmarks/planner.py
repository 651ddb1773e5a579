"""The SLO planner against every static prefill:decode split (issue 28, item 4).

A script, not a test. One trace, replayed against `tandem serve --engine sim` once per static
split P:D of a worker budget (P + D = ``--budget``) and once with ``--planner --max-workers
budget``; one table of SLO goodput and worker-seconds per phase and over the whole trace.

**Time.** The simulated workers run the H100 profile (``--profile``) slowed ``--slowdown`` times
(a copy of the profile with every step time multiplied, every prefill rate divided), because the
H100's ~200 tokens/s per stream times hundreds of streams is more SSE than the router and the
client on a 2-core machine can carry. Arrival rates and SLOs are given in the profile's own
(H100) time and scaled here, and the table is in H100 time again: goodput = requests meeting both
SLOs per H100-second, worker-seconds = wall seconds x replicas holding a worker / slowdown (for
the planner: the ones it asks for, starting ones included, and those still draining). Queueing is the same at
any slowdown; what does not scale is everything real (the router, a worker's start, the planner's
interval): those are faster in H100 time than they would be (a started sim worker serves in a few
wall seconds, a real 8B one takes a minute). At slowdown 10 the TTFT SLO of 500 ms is 5 s of
wall time, a bound of the router's histogram, so the planner's "TTFT p90 over the SLO" is exact.

**Trace** (``--phases NAME:WALL_SECONDS,...``, Poisson arrivals, seed ``--seed``, the same
arrival times and prompts for every system). A phase whose name starts with

- ``chat`` sends ``--chat-rate`` requests/s of ``--chat-prompt``-token prompts and
  ``--chat-output`` tokens out: decode-bound (defaults 17.5/s of 1024 -> 768: ~75 streams of
  ~1400 tokens of context; two decode workers break the 6 ms ITL SLO, three keep it, and one
  prefill worker computes the prompts at ~70% of its capacity);
- ``doc`` sends long-document summarisation, ``--doc-rate`` requests/s of ``--doc-prompt`` tokens,
  ``--doc-output`` out: prefill-bound (defaults 13.7/s of 4096 -> 64: 2.2 prefill workers' worth of
  prompt tokens, so two run over capacity and three at 75%; one decode worker carries the output);
- ``ramp`` sends chat whose rate rises linearly from ``--ramp-from`` x chat-rate to chat-rate.

The default ``chat:75,doc:135,ramp:100`` (wall seconds: 7.5, 13.5 and 10 H100-seconds at the
default slowdown 10) needs 1:3 for chat and 3:1 for documents, so no static split of 4 carries
every phase. A chat stream lives ~4.4 H100-seconds (768 tokens at ~5.7 ms), so a phase is 2-3
stream lives long: shorter phases never reach their steady load (the 2026-11-27 trace of 80 s
phases at slowdown 60 had streams longer than its phases, and 2:2 carried everything).

A request meets the SLOs when its TTFT (request sent -> first token, at the client) is at most
``--ttft-slo-ms`` and its mean inter-token time ((last token - first token) / (tokens - 1)) at
most ``--itl-slo-ms``; a failed request meets neither. A request counts in the phase it arrived
in. Every prompt is new (no prefix-cache hits) and the router prefills nothing itself
(``--local-prefill-max-tokens 0``), so the split decides where every token is computed.

    python benchmarks/planner.py [--budget 4] [--splits 1:3,2:2,3:1] [--phases chat:75,doc:135,ramp:100]

Everything listens on 127.0.0.1; each deployment is stopped with Ctrl-C even on errors. Prints a
JSON line per system, then the table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from scale_sim import DEFAULT_PROFILE, Result, client_for, slowed_profile, stream
from soak import Deployment

KINDS = ("chat", "doc", "ramp")


@dataclass(frozen=True)
class Request:
    at_s: float          # wall seconds after the trace starts
    phase: str
    prompt_len: int
    max_tokens: int
    seed: int


def phases(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    """``--phases`` as (name, start, end) in wall seconds."""
    out, start = [], 0.0
    for item in args.phases.split(","):
        name, _, seconds = item.partition(":")
        if not name.rstrip("-0123456789").startswith(KINDS) or not seconds:
            raise SystemExit(f"--phases: {item!r} is not NAME:SECONDS with NAME starting with one of {KINDS}")
        out.append((name, start, start + float(seconds)))
        start += float(seconds)
    return out


def trace(args: argparse.Namespace) -> list[Request]:
    """Poisson arrivals per phase, in wall seconds (rates given per H100-second, / slowdown)."""
    rng = random.Random(args.seed)
    out: list[Request] = []
    for phase, start, end in phases(args):
        t = 0.0
        doc = phase.startswith("doc")
        prompt_len, max_tokens = (args.doc_prompt, args.doc_output) if doc else (args.chat_prompt, args.chat_output)
        peak = (args.doc_rate if doc else args.chat_rate) / args.slowdown
        while True:
            # The ramp's rate at t: thinning a Poisson process of the peak rate.
            t += rng.expovariate(peak)
            if t >= end - start:
                break
            if phase.startswith("ramp"):
                rate = args.ramp_from + (1 - args.ramp_from) * t / (end - start)
                if rng.random() > rate:
                    continue
            out.append(Request(start + t, phase, prompt_len, max_tokens, rng.randrange(1 << 30)))
    return out


def prompt(request: Request) -> list[int]:
    rng = random.Random(request.seed)
    return [rng.randrange(100, 40000) for _ in range(request.prompt_len)]


def meets(result: Result, request: Request, args: argparse.Namespace) -> tuple[bool, bool]:
    """Whether the request met the TTFT SLO, and the ITL SLO (a failed request meets neither)."""
    if not result.ok or result.ttft_s is None or result.num_tokens < request.max_tokens:
        return False, False
    tpot = sum(result.itl_s) / max(1, request.max_tokens - 1)
    return result.ttft_s <= args.ttft_slo_ms * args.slowdown / 1e3, tpot <= args.itl_slo_ms * args.slowdown / 1e3


async def replay(http: str, model: str, requests: list[Request], args: argparse.Namespace,
                 replicas_at: list[tuple[float, int, int]], planner_metrics: str | None) -> list[Result]:
    """Send every request at its time; meanwhile sample the replicas that hold a worker (the
    planner's ``tandem_planner_held_replicas``: those asked for, starting ones included, and those
    still draining), every second, into ``replicas_at`` as (wall s, prefill, decode)."""
    timeout_s = max(600.0, 2 * phases(args)[-1][2])
    async with client_for(http, 4096) as client:
        t0 = time.monotonic()

        async def one(request: Request) -> Result:
            await asyncio.sleep(max(0.0, t0 + request.at_s - time.monotonic()))
            return await stream(client, model, prompt(request), request.max_tokens, timeout_s)

        async def sample() -> None:
            async with httpx.AsyncClient(timeout=5) as metrics:
                while True:
                    if planner_metrics:
                        try:
                            text = (await metrics.get(f"http://{planner_metrics}/metrics")).text
                            got = dict(re.findall(r'tandem_planner_held_replicas\{role="(\w+)"\} ([\d.]+)', text))
                            replicas_at.append((time.monotonic() - t0, int(float(got["prefill"])),
                                                int(float(got["decode"]))))
                        except (httpx.HTTPError, KeyError, ValueError):
                            pass
                    await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample())
        try:
            return list(await asyncio.gather(*(one(r) for r in requests)))
        finally:
            sampler.cancel()


def worker_seconds(replicas_at: list[tuple[float, int, int]], start: float, end: float) -> float:
    """Integral of prefill + decode replicas over [start, end) wall seconds, from the samples
    (each holds until the next)."""
    total = 0.0
    for (t, p, d), (t_next, _, _) in zip(replicas_at, replicas_at[1:] + [(float("inf"), 0, 0)]):
        lo, hi = max(t, start), min(t_next, end)
        if hi > lo:
            total += (hi - lo) * (p + d)
    return total


def run_system(name: str, flags: list[str], requests: list[Request], args: argparse.Namespace,
               profile_file: Path, workdir: Path) -> dict:
    static = re.fullmatch(r"(\d+):(\d+)", name)
    dep = Deployment(workdir / f"serve-{name.replace(':', '-')}.log",
                     ["--engine", "sim", "--sim-profile", str(profile_file), "--local-prefill-max-tokens", "0",
                      "--max-model-len", str(max(args.doc_prompt, args.chat_prompt) + 1024),
                      "--max-num-seqs", str(args.max_num_seqs),
                      *flags, *args.serve_flags], {})
    replicas_at: list[tuple[float, int, int]] = []
    try:
        dep.wait_ready(300)
        planner_metrics = None if static else dep.status()["planner"]["metrics"]
        first = static or re.fullmatch(r"(\d+):(\d+)", args.planner_start)
        assert first is not None, "--planner-start is P:D"
        replicas_at.append((0.0, int(first[1]), int(first[2])))
        t0 = time.monotonic()
        results = asyncio.run(replay(dep.http, f"sim:{profile_file}", requests, args, replicas_at, planner_metrics))
        wall = time.monotonic() - t0
    finally:
        dep.stop()
    k = args.slowdown
    row: dict = {"system": name, "wall_s": round(wall, 1), "phases": {}}
    spans = {phase: (start, end) for phase, start, end in phases(args)}
    spans["all"] = (0.0, phases(args)[-1][2])
    for phase, (lo, hi) in spans.items():
        mine = [(q, r) for q, r in zip(requests, results) if phase == "all" or q.phase == phase]
        met = [meets(r, q, args) for q, r in mine]
        good = sum(ttft and itl for ttft, itl in met)
        ttft = sorted(r.ttft_s for _, r in mine if r.ttft_s is not None)
        row["phases"][phase] = {
            "requests": len(mine), "failed": sum(not r.ok for _, r in mine), "good": good,
            "ttft_met": sum(ttft for ttft, _ in met), "itl_met": sum(itl for _, itl in met),
            "goodput": round(good / ((hi - lo) / k), 2),
            "worker_s": round(worker_seconds(replicas_at, lo, hi) / k, 2),
            "ttft_p90_ms": round(ttft[int(0.9 * (len(ttft) - 1))] * 1e3 / k, 1) if ttft else None}
    if not static:
        row["replicas"] = [(round(t, 1), p, d) for (t, p, d), prev in zip(replicas_at, [None] + replicas_at)
                           if prev is None or prev[1:] != (p, d)]
    return row


def table(rows: list[dict]) -> str:
    names = list(rows[0]["phases"])
    head = "| system | " + " | ".join(f"{p} goodput / worker-s" for p in names) + " | failed |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for row in rows:
        cells = [f"{row['phases'][p]['goodput']:.1f} / {row['phases'][p]['worker_s']:.1f}" for p in names]
        lines.append(f"| {row['system']} | " + " | ".join(cells) + f" | {row['phases']['all']['failed']} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=str(DEFAULT_PROFILE))
    p.add_argument("--slowdown", type=float, default=10.0)
    p.add_argument("--budget", type=int, default=4, help="prefill + decode workers of every system")
    p.add_argument("--splits", default=None, help="static P:D splits to run (default: every one of the budget)")
    p.add_argument("--no-planner", action="store_true")
    p.add_argument("--planner-start", default=None, help="the planner's first P:D (default: half the budget each)")
    p.add_argument("--planner-interval-s", type=float, default=2.0, help="wall seconds")
    p.add_argument("--phases", default="chat:70,doc:100,ramp:90",
                   help="NAME:WALL_SECONDS,...; a name starting with chat, doc or ramp sends that load")
    p.add_argument("--ttft-slo-ms", type=float, default=500.0, help="H100 ms")
    p.add_argument("--itl-slo-ms", type=float, default=6.0, help="H100 ms")
    p.add_argument("--chat-rate", type=float, default=17.5, help="requests per H100-second")
    p.add_argument("--chat-prompt", type=int, default=1024)
    p.add_argument("--chat-output", type=int, default=768)
    p.add_argument("--doc-rate", type=float, default=13.7)
    p.add_argument("--doc-prompt", type=int, default=4096)
    p.add_argument("--doc-output", type=int, default=64)
    p.add_argument("--ramp-from", type=float, default=0.15, help="the ramp's first rate, a fraction of --chat-rate")
    p.add_argument("--max-num-seqs", type=int, default=256, help="decode batch cap of every worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("serve_flags", nargs="*", help="after --: extra `tandem serve` flags for every system")
    args = p.parse_args()

    profile = json.loads(Path(args.profile).read_text())
    workdir = Path(tempfile.mkdtemp(prefix="tandem-planner-bench-"))
    profile_file = workdir / "slowed.json"
    profile_file.write_text(json.dumps(slowed_profile(profile, args.slowdown)))
    requests = trace(args)
    splits = [f"{n}:{args.budget - n}" for n in range(1, args.budget)] if args.splits is None else \
        [s for s in args.splits.split(",") if s]
    args.planner_start = args.planner_start or f"{args.budget // 2}:{args.budget - args.budget // 2}"
    start = args.planner_start.split(":")
    systems = [(s, ["--prefill", s.split(":")[0], "--decode", s.split(":")[1]]) for s in splits]
    if not args.no_planner:
        systems.append(("planner", ["--prefill", start[0], "--decode", start[1], "--planner",
                                    "--ttft-slo-ms", f"{args.ttft_slo_ms * args.slowdown:g}",
                                    "--itl-slo-ms", f"{args.itl_slo_ms * args.slowdown:g}",
                                    "--max-workers", str(args.budget),
                                    "--planner-interval-s", f"{args.planner_interval_s:g}"]))
    print(f"# {len(requests)} requests over {args.phases} (wall s); logs in {workdir}", flush=True)
    rows = []
    for name, flags in systems:
        row = run_system(name, flags, requests, args, profile_file, workdir)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
