"""Goodput under SLOs, Tandem against vLLM-CPU, over a sweep of request rates (a script, not a test).

Goodput is the rate of requests that meet both a TTFT and a TPOT objective (DistServe, Dynamo,
vLLM's ``--goodput``): the measure P/D disaggregation exists for. The workload is bursty and
mixed: Poisson arrivals of short chat-sized prompts with long documents among them
(``tandem bench --dataset mixed``: ``--long-fraction`` of the prompts ``--long-len`` tokens, the
rest ``--short-len``), every request ``--output-len`` tokens (ignore_eos). Each system is served
on its own, one after the other, on the same cores, and the same client (``tandem bench``) runs
every rate against it, with a seed of its own per rate: the same prompts and arrival times for
every system at a rate, new prompts at each rate (one seed for all would send every rate after
the first prompts the server still has in its prefix cache; the hits are counted per rate, as
``prefix_hit_tokens``, and 0 is a clean run):

- ``tandem``: ``tandem serve`` with its defaults (prompts prefilled on the decode worker up to
  its local-prefill threshold);
- ``tandem-pd``: ``tandem serve --local-prefill-max-tokens 0`` (every prompt prefilled on the
  prefill worker, decode isolated from prefill bursts);
- ``tandem-slo``: the defaults told the objectives, as a user with them would:
  ``--max-predicted-wait-s <TTFT objective> --max-tpot-s <TPOT objective x --tpot-margin>``. The
  router refuses (429) a request whose first token it predicts later than the one, or while the
  running streams are slower than the other (router/admission.py), so the requests it takes keep
  their SLOs under overload; a refused request counts as failed, never as good;
- ``vllm``: ``../shared/peers/vllm_serve.sh`` (vLLM-CPU 0.32 in its best dtype for the CPU).

Prints per rate each system's goodput, completed/failed (and the router's refusals by limit), TTFT
and TPOT p50/p99, then vLLM's knee (the lowest rate after which its goodput rises by less than
5%) and Tandem's goodput there.
Default SLOs (TTFT <= 3 s, TPOT <= 100 ms) are what a CPU serving SmolLM2-135M can meet at
light load: a 1.5k-token prompt prefills in ~0.6 s and a decode step of a few sequences takes
20-60 ms on 2 cores, so a missed SLO means queueing or interference, not the hardware's floor.

    python benchmarks/goodput.py [--rates 0.25,0.5,1,2] [--num-prompts 24] [--systems tandem,tandem-pd,tandem-slo,vllm]
                                 [--slo-ttft-ms 3000] [--slo-tpot-ms 100] [--tandem-args "--chunked-prefill-size 1024"]
                                 [--out /tmp/tandem-goodput]

Run it on a quiet machine (nothing else on the cores); results go to --out (one JSON per system
and rate, plus summary.json).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import httpx

# Run as a script, this file's folder comes first on sys.path: put the repository root there.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks.vs_vllm import PEERS, prefix_hit_tokens, scenario_seed, serve, stop  # noqa: E402

TANDEM = str(Path(sys.executable).parent / "tandem")
SYSTEMS = {
    # name: (argv, port, served model name, ready text, start-up timeout)
    "tandem": ([TANDEM, "serve", "--address", "local", "--http-port", "8000", "--grpc-port", "0"], 8000,
               "smollm2-135m-instruct", "Tandem is serving", 600),
    "tandem-pd": ([TANDEM, "serve", "--address", "local", "--http-port", "8000", "--grpc-port", "0",
                   "--local-prefill-max-tokens", "0"], 8000, "smollm2-135m-instruct", "Tandem is serving", 600),
    "tandem-slo": ([TANDEM, "serve", "--address", "local", "--http-port", "8000", "--grpc-port", "0"], 8000,
                   "smollm2-135m-instruct", "Tandem is serving", 600),   # + the SLO flags (main)
    "vllm": (["bash", str(PEERS / "vllm_serve.sh")], 8100, "smollm2-135m", None, 900),
}
ROW = ("request_goodput", "completed", "failed", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
       "prefix_hit_tokens", "refused")


def refused(name: str, port: int) -> dict[str, float]:
    """Requests the router has refused at admission since it started, by limit (Tandem only)."""
    if not name.startswith("tandem"):
        return {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    prefix = 'tandem_request_refused_total{limit="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def run_rate(name: str, port: int, model: str, rate: float, args: argparse.Namespace) -> dict:
    path = args.out / f"{name}_rate{rate:g}.json"
    argv = [TANDEM, "bench", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--model", model,
            "--dataset", "mixed", "--short-len", str(args.short_len), "--long-len", str(args.long_len),
            "--long-fraction", str(args.long_fraction), "--output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--request-rate", str(rate),
            "--seed", str(scenario_seed(args.seed, f"rate{rate:g}")),
            "--ignore-eos", "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
            "--timeout-s", "600", "--no-progress", "--json"]
    hits, refused_before = prefix_hit_tokens(name, port), refused(name, port)
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    summary["prefix_hit_tokens"] = prefix_hit_tokens(name, port) - hits
    summary["refused"] = {k: int(v - refused_before.get(k, 0)) for k, v in refused(name, port).items()
                          if v > refused_before.get(k, 0)}
    path.write_text(json.dumps(summary, indent=1))
    row = {k: summary.get(k) for k in ROW}
    print(f"[{name}] rate {rate:g}/s: " + ", ".join(f"{k} {_fmt(v)}" for k, v in row.items()), flush=True)
    return row


def knee(rates: list[float], goodput: list[float]) -> float:
    """The lowest rate after which goodput rises by less than 5% (the last rate if it never stops)."""
    for i in range(len(rates) - 1):
        if goodput[i + 1] < goodput[i] * 1.05:
            return rates[i]
    return rates[-1]


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) and v < 10 else f"{v:.0f}" if isinstance(v, float) \
        else str(v)


def print_table(results: dict[str, dict[float, dict]], rates: list[float]) -> None:
    names = list(results)
    print(f"\n{'rate/s':>7} " + " ".join(f"{n + ' goodput':>18} {'done/fail':>9} {'TTFT p50':>9} {'TPOT p50':>9}"
                                         for n in names))
    for rate in rates:
        cells = []
        for n in names:
            r = results[n].get(rate)
            if r is None:
                cells.append(f"{'-':>18} {'-':>9} {'-':>9} {'-':>9}")
                continue
            cells.append(f"{r['request_goodput'] or 0:>18.3f} {r['completed']:>4}/{r['failed']:<4} "
                         f"{(r['median_ttft_ms'] or 0):>9.0f} {(r['median_tpot_ms'] or 0):>9.1f}")
        print(f"{rate:>7g} " + " ".join(cells))
    if "vllm" in results and len(results["vllm"]) == len(rates):
        k = knee(rates, [results["vllm"][r]["request_goodput"] or 0.0 for r in rates])
        v = results["vllm"][k]["request_goodput"] or 0.0
        print(f"\nvLLM's knee: {k:g} req/s (goodput {v:.3f})")
        for n in names:
            if n != "vllm" and k in results[n]:
                g = results[n][k]["request_goodput"] or 0.0
                print(f"  {n}: goodput {g:.3f} there ({g / v:.2f}x)" if v else f"  {n}: goodput {g:.3f} there")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="0.25,0.5,1,2", help="request rates (req/s), comma-separated")
    parser.add_argument("--systems", default="tandem,tandem-pd,vllm", help=f"of {','.join(SYSTEMS)}")
    parser.add_argument("--num-prompts", type=int, default=24, help="requests per rate")
    parser.add_argument("--short-len", type=int, default=128)
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--long-fraction", type=float, default=0.2)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--tpot-margin", type=float, default=0.9,
                        help="tandem-slo's --max-tpot-s is this share of the TPOT objective (the streams taken "
                             "while the pace is just under the limit slow it further)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/tandem-goodput"))
    parser.add_argument("--tandem-args", default="", help="extra `tandem serve` flags for the tandem systems")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown system(s) {unknown}: use {','.join(SYSTEMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"load_average_before": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
                     "results": {}}
    results: dict[str, dict[float, dict]] = {}
    for name in systems:
        cmd, port, model, ready, timeout_s = SYSTEMS[name]
        if name.startswith("tandem"):
            cmd = [*cmd, *shlex.split(args.tandem_args)]
        if name == "tandem-slo":
            cmd = [*cmd, "--max-predicted-wait-s", f"{args.slo_ttft_ms / 1000:g}",
                   "--max-tpot-s", f"{args.slo_tpot_ms * args.tpot_margin / 1000:g}"]
        proc, summary[f"{name}_startup_s"] = serve(name, cmd, port, args.out / f"{name}.log", timeout_s, ready)
        try:
            results[name] = {rate: run_rate(name, port, model, rate, args) for rate in rates}
        finally:
            stop(proc)
        summary["results"][name] = {str(r): row for r, row in results[name].items()}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_table(results, rates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
