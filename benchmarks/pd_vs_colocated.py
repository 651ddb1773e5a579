"""Disaggregated prefill/decode vs the colocated engine under a prefill burst (a script, not a test).

Runs one seeded workload against (A) a real prefill worker + a real decode worker, separate
processes started as `tandem serve --local-prefill-max-tokens 0` starts 1P1D on 2 cores (prefill
2 torch threads niced 5 below decode, decode 1), driven over gRPC the way the router drives them
(docs/architecture.md#request-flow: start on the decode worker's Session stream, submit on the
prefill worker's, concurrently), and (B) the colocated LLMEngine, stepped by a server thread in
this process with requests added at their arrival times, once per entry of --colocated-threads
(the first is the baseline of the headline; with 2 threads it owns both cores, with 1 it matches
one worker's share). `tandem serve`'s default on one CPU node (conditional disaggregation:
prompts of up to 4096 tokens prefilled on the decode worker, which gets both cores) computes
every prompt of this workload the way (B) with 2 threads does, in a worker process.

Workload: Poisson arrivals of steady requests (prompt --prompt-len random token ids, exactly
--output-len greedy tokens, ignore_eos) plus --burst-size long prompts (--burst-prompt-len,
--burst-output-len tokens) arriving together mid-run while steady decodes are in flight.

Per system it prints TTFT and TPOT (vLLM's: (last token - first token) / (n - 1)) p50/p99 of
the steady requests, the p99 inter-token latency of steady requests inside the burst window
(burst arrival -> last burst first token) and outside it, output tokens/s over the run, and the
headline ratios disaggregated / colocated. Disaggregated times are taken where the client
receives each GenerateResponse; colocated ones when engine.step() returns its StepOutputs.

    python benchmarks/pd_vs_colocated.py [--request-rate 0.3] [--num-requests 12] [--burst-size 4] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFILL_NICE = 5          # tandem serve --prefill-nice's default
# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# `engine` package: put the repository root there instead.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO_ROOT)

from deploy.launch import WorkerProcess  # noqa: E402
from protos.auth import SECRET_ENV, SecretStub, new_secret, require_secret  # noqa: E402

os.environ.setdefault(SECRET_ENV, new_secret())   # the workers it starts inherit this deployment's secret


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    kind: str                 # "steady" | "burst"
    arrival_s: float          # offset from the start of the run
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class Trace:
    spec: RequestSpec
    arrival_s: float = 0.0                               # absolute time.monotonic()
    token_s: list[float] = field(default_factory=list)   # one receive time per output token
    error: str | None = None


# -- workload ----------------------------------------------------------------------------------
def make_workload(args: argparse.Namespace) -> tuple[list[RequestSpec], float]:
    """Steady Poisson stream plus one burst; returns the specs (sorted) and the burst offset."""
    rng = random.Random(args.seed)

    def prompt(num_tokens: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(num_tokens)]

    specs, t = [], 0.0
    for i in range(args.num_requests):
        specs.append(RequestSpec(f"steady-{i}", "steady", t, prompt(args.prompt_len), args.output_len))
        t += rng.expovariate(args.request_rate)
    burst_at_s = args.burst_at_s if args.burst_at_s is not None else specs[args.num_requests // 2].arrival_s + 1.0
    specs += [RequestSpec(f"burst-{i}", "burst", burst_at_s, prompt(args.burst_prompt_len), args.burst_output_len)
              for i in range(args.burst_size)]
    return sorted(specs, key=lambda s: s.arrival_s), burst_at_s


# -- (A) disaggregated: two worker processes ---------------------------------------------------
def start_worker(role: str, flags: list[str], log_dir: str) -> WorkerProcess:
    """Spawn a worker with its stderr in ``log_dir/<role>.log`` (ready: ``wait_ready``), the way
    `tandem serve` starts 1P1D on a 2-core node: prefill niced 5 below decode."""
    log = open(Path(log_dir) / f"{role}.log", "wb")  # noqa: SIM115 - the child writes it until it exits
    return WorkerProcess(role, flags, stderr=log, wait=False,
                         nice=PREFILL_NICE if role == "prefill" else 0)


def worker_flags(args: argparse.Namespace, role: str) -> list[str]:
    """`tandem serve`'s defaults on 2 cores: prefill 2 threads (all the cores), decode 1."""
    threads = 2 if role == "prefill" else 1
    return ["--model", args.model, "--dtype", args.dtype, "--device", "cpu", "--num-threads", str(threads),
            "--num-gpu-blocks-override", str(args.num_blocks), "--chunked-prefill-size",
            str(args.chunked_prefill_size), "--metrics-port", "-1", "--log-level", "WARNING"]


async def _client_request(stubs, spec: RequestSpec, start_s: float, prefill_address: str,
                          decode_address: str, trace: Trace) -> None:
    from protos.tandem.v1 import worker_pb2

    await asyncio.sleep(max(0.0, start_s + spec.arrival_s - time.monotonic()))
    prefill, decode = stubs    # router.session's PrefillSession and DecodeSession
    sampling = worker_pb2.SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
    trace.arrival_s = time.monotonic()
    stream = decode.generate(worker_pb2.GenerateRequest(request_id=spec.request_id,
                                                        prompt_token_ids=spec.prompt_token_ids,
                                                        sampling=sampling, prefill_address=prefill_address))
    submit = asyncio.ensure_future(prefill.submit(worker_pb2.SubmitRequest(
        request_id=spec.request_id, prompt_token_ids=spec.prompt_token_ids, sampling=sampling,
        decode_address=decode_address), 300.0))
    try:
        async for response in stream:
            now = time.monotonic()
            trace.token_s += [now] * len(response.token_ids)
            if response.finish_reason and response.finish_reason != "length":
                trace.error = f"finish_reason={response.finish_reason}"
        await submit
    except Exception as exc:  # noqa: BLE001 - reported per request, the run goes on
        trace.error = f"{type(exc).__name__}: {exc}"
        stream.cancel()
        submit.cancel()


async def _drive_workers(specs: list[RequestSpec], addresses: dict[str, str], timeout_s: float,
                         warmup: RequestSpec) -> list[Trace]:
    import grpc

    from protos.tandem.v1 import worker_pb2_grpc
    from router.session import DecodeSession, PrefillSession

    async with grpc.aio.insecure_channel(addresses["prefill"]) as p_ch, \
            grpc.aio.insecure_channel(addresses["decode"]) as d_ch:
        secret = require_secret("the benchmark")
        stubs = (PrefillSession(SecretStub(worker_pb2_grpc.PrefillWorkerStub(p_ch), secret), addresses["prefill"]),
                 DecodeSession(SecretStub(worker_pb2_grpc.DecodeWorkerStub(d_ch), secret), addresses["decode"]))
        warm = Trace(warmup)
        await _client_request(stubs, warmup, time.monotonic(), addresses["prefill"], addresses["decode"], warm)
        if warm.error or len(warm.token_s) != warmup.max_tokens:
            raise RuntimeError(f"warm-up request failed: {warm.error}, {len(warm.token_s)} tokens")
        traces = [Trace(s) for s in specs]
        start_s = time.monotonic()
        tasks = [asyncio.ensure_future(_client_request(stubs, s, start_s, addresses["prefill"],
                                                       addresses["decode"], t)) for s, t in zip(specs, traces)]
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for trace in traces:
            if trace.error is None and len(trace.token_s) < trace.spec.max_tokens:
                trace.error = "timed out"
        for session in stubs:
            await session.close()
        return traces


def run_disaggregated(specs: list[RequestSpec], args: argparse.Namespace, warmup: RequestSpec) -> list[Trace]:
    with tempfile.TemporaryDirectory(prefix="tandem-pd-bench-") as tmp_dir:
        log_dir = args.log_dir or tmp_dir
        workers = []
        try:
            workers = [start_worker(role, worker_flags(args, role), log_dir) for role in ("prefill", "decode")]
            addresses = {w.role: w.wait_ready(args.startup_timeout_s)["grpc"] for w in workers}
            return asyncio.run(_drive_workers(specs, addresses, args.timeout_s, warmup))
        finally:
            for worker in workers:
                worker.stop()


# -- (B) colocated: the engine stepped by a server thread ----------------------------------------
class ColocatedServer:
    """A thread that adds requests between steps and timestamps each StepOutput."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue[tuple[Trace, object]] = queue.SimpleQueue()
        self.traces: dict[str, Trace] = {}
        self.stopping = threading.Event()
        self.wake = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="colocated-engine", daemon=True)

    def submit(self, trace: Trace, params) -> None:
        trace.arrival_s = time.monotonic()
        self.inbox.put((trace, params))
        self.wake.set()

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                while not self.inbox.empty():
                    trace, params = self.inbox.get()
                    self.traces[trace.spec.request_id] = trace
                    self.engine.add_request(trace.spec.request_id, trace.spec.prompt_token_ids, params)
                if not self.engine.has_unfinished():
                    self.wake.wait(0.002)
                    self.wake.clear()
                    continue
                outputs = self.engine.step()
                now = time.monotonic()
                for out in outputs:
                    self.traces[out.request_id].token_s += [now] * len(out.new_token_ids)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the driver
            self.error = exc


def run_colocated(specs: list[RequestSpec], args: argparse.Namespace, num_threads: int,
                  warmup: RequestSpec) -> list[Trace]:
    import torch

    from engine.config import CacheConfig, ModelConfig, SamplingParams, SchedulerConfig
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(num_threads)
    engine = LLMEngine(ModelConfig(model=args.model, dtype=args.dtype, device="cpu"),
                       CacheConfig(num_gpu_blocks_override=args.num_blocks, shared_memory=False),
                       SchedulerConfig(chunked_prefill_size=args.chunked_prefill_size))
    server = ColocatedServer(engine)
    try:
        server.thread.start()
        traces = [Trace(s) for s in [warmup] + specs]
        params = [SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True) for s in [warmup] + specs]
        server.submit(traces[0], params[0])
        _wait(server, traces[:1], args.timeout_s)
        start_s = time.monotonic()
        for trace, p in zip(traces[1:], params[1:]):
            time.sleep(max(0.0, start_s + trace.spec.arrival_s - time.monotonic()))
            server.submit(trace, p)
        _wait(server, traces[1:], args.timeout_s - (time.monotonic() - start_s))
        return traces[1:]
    finally:
        server.stopping.set()
        server.wake.set()
        server.thread.join(60)
        engine.close()


def _wait(server: ColocatedServer, traces: list[Trace], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(len(t.token_s) < t.spec.max_tokens for t in traces):
        if server.error is not None:
            raise RuntimeError("colocated engine thread died") from server.error
        if time.monotonic() > deadline:
            for t in traces:
                if len(t.token_s) < t.spec.max_tokens:
                    t.error = "timed out"
            return
        time.sleep(0.01)


# -- metrics -----------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(traces: list[Trace]) -> dict:
    ok = [t for t in traces if t.error is None and t.token_s]
    steady = [t for t in ok if t.spec.kind == "steady"]
    burst = [t for t in traces if t.spec.kind == "burst"]
    # Burst window: from the burst's arrival until its last prompt has produced a first token
    # (every burst prefill is done); a steady ITL gap is "in" it when the two overlap.
    window = (min((t.arrival_s for t in burst), default=0.0),
              max((t.token_s[0] for t in burst if t.token_s), default=0.0))
    itl_in, itl_out = [], []
    for t in steady:
        for prev, cur in zip(t.token_s, t.token_s[1:]):
            (itl_in if prev <= window[1] and cur >= window[0] else itl_out).append(cur - prev)
    tpot = [(t.token_s[-1] - t.token_s[0]) / (len(t.token_s) - 1) for t in steady if len(t.token_s) > 1]
    ttft = [t.token_s[0] - t.arrival_s for t in steady]
    span_s = max(t.token_s[-1] for t in ok) - min(t.arrival_s for t in ok) if ok else float("nan")
    num_tokens = sum(len(t.token_s) for t in ok)
    ms = 1000.0
    return {
        "num_ok": len(ok), "num_failed": len(traces) - len(ok),
        "errors": sorted({t.error for t in traces if t.error})[:5],
        "ttft_p50_ms": percentile(ttft, 50) * ms, "ttft_p99_ms": percentile(ttft, 99) * ms,
        "tpot_p50_ms": percentile(tpot, 50) * ms, "tpot_p99_ms": percentile(tpot, 99) * ms,
        "itl_p99_in_burst_ms": percentile(itl_in, 99) * ms, "itl_p99_outside_burst_ms": percentile(itl_out, 99) * ms,
        "itl_max_in_burst_ms": max(itl_in, default=float("nan")) * ms, "num_itl_in_burst": len(itl_in),
        "burst_ttft_max_ms": max((t.token_s[0] - t.arrival_s for t in burst if t.token_s),
                                 default=float("nan")) * ms,
        "burst_window_s": window[1] - window[0],
        "output_tokens": num_tokens, "duration_s": span_s, "output_tokens_per_s": num_tokens / span_s,
    }


ROWS = [("steady TTFT p50 / p99 (ms)", "ttft_p50_ms", "ttft_p99_ms"),
        ("steady TPOT p50 / p99 (ms)", "tpot_p50_ms", "tpot_p99_ms"),
        ("steady ITL p99 in / out of burst (ms)", "itl_p99_in_burst_ms", "itl_p99_outside_burst_ms"),
        ("steady ITL max in burst (ms), #gaps", "itl_max_in_burst_ms", "num_itl_in_burst"),
        ("burst TTFT max (ms), window (s)", "burst_ttft_max_ms", "burst_window_s"),
        ("output tokens, run (s)", "output_tokens", "duration_s"),
        ("output tokens/s", "output_tokens_per_s", None),
        ("requests ok / failed", "num_ok", "num_failed")]


def _fmt(value: float) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def print_table(results: dict[str, dict]) -> None:
    names = list(results)
    print(f"\n{'':40}" + "".join(f"{n:>26}" for n in names))
    for label, a, b in ROWS:
        cells = []
        for n in names:
            r = results[n]
            cells.append(_fmt(r[a]) if b is None else f"{_fmt(r[a])} / {_fmt(r[b])}")
        print(f"{label:40}" + "".join(f"{c:>26}" for c in cells))
    for n in names:
        if results[n]["errors"]:
            print(f"  {n} errors: {results[n]['errors']}")


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto", help="the engine default: bfloat16 on CPUs with native bf16")
    p.add_argument("--request-rate", type=float, default=0.3, help="steady Poisson arrivals per second")
    p.add_argument("--num-requests", type=int, default=12, help="steady requests")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--burst-size", type=int, default=4)
    p.add_argument("--burst-prompt-len", type=int, default=2048)
    p.add_argument("--burst-output-len", type=int, default=16)
    p.add_argument("--burst-at-s", type=float, default=None,
                   help="burst arrival offset (default: 1 s after the middle steady request)")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per pool (each system)")
    p.add_argument("--chunked-prefill-size", type=int, default=0, help="0: the engine's auto (512 on CPU)")
    p.add_argument("--colocated-threads", default="2,1", help="torch threads per colocated run; first = baseline")
    p.add_argument("--no-disaggregated", action="store_true", help="only run the colocated engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per system, after the warm-up")
    p.add_argument("--startup-timeout-s", type=float, default=180.0)
    p.add_argument("--log-dir", default=None, help="keep the workers' stderr logs here (default: discarded)")
    p.add_argument("--json", action="store_true", help="also print one JSON line with every number")
    args = p.parse_args(argv)
    if args.request_rate <= 0 or args.num_requests < 1 or args.output_len < 2:
        p.error("--request-rate must be > 0, --num-requests >= 1, --output-len >= 2")
    return args


def _raise_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)   # unwinds through the finally blocks that stop the workers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    specs, burst_at_s = make_workload(args)
    warmup = RequestSpec("warmup", "warmup", 0.0, [random.Random(-1).randrange(100, 40000) for _ in range(64)], 4)
    load_before = os.getloadavg()
    print(f"workload: {args.num_requests} steady requests ({args.prompt_len} prompt + {args.output_len} output "
          f"tokens, Poisson {args.request_rate}/s, last arrival {max(s.arrival_s for s in specs):.1f} s), burst of "
          f"{args.burst_size} x {args.burst_prompt_len}-token prompts ({args.burst_output_len} output) at "
          f"{burst_at_s:.1f} s; {args.model} {args.dtype}, chunked prefill {args.chunked_prefill_size}, "
          f"{args.num_blocks} KV blocks per pool; load average {load_before[0]:.2f} on {os.cpu_count()} CPUs",
          flush=True)
    results: dict[str, dict] = {}
    if not args.no_disaggregated:
        t0 = time.monotonic()
        results["disaggregated 1P+1D"] = summarize(run_disaggregated(specs, args, warmup))
        print(f"disaggregated (prefill worker 2 torch threads niced {PREFILL_NICE}, decode worker 1): done in "
              f"{time.monotonic() - t0:.0f} s", flush=True)
    for num_threads in [int(n) for n in args.colocated_threads.split(",") if n]:
        t0 = time.monotonic()
        results[f"colocated x{num_threads}t"] = summarize(run_colocated(specs, args, num_threads, warmup))
        print(f"colocated (one LLMEngine, {num_threads} torch thread(s)): done in {time.monotonic() - t0:.0f} s",
              flush=True)
    load_after = os.getloadavg()
    print_table(results)
    ratios = {}
    disagg = results.get("disaggregated 1P+1D")
    for name, r in results.items():
        if disagg is not None and name.startswith("colocated"):
            ratios[name] = {"tpot_p99": disagg["tpot_p99_ms"] / r["tpot_p99_ms"],
                            "throughput": disagg["output_tokens_per_s"] / r["output_tokens_per_s"]}
    print()
    for i, (name, ratio) in enumerate(ratios.items()):
        tag = "headline" if i == 0 else "also"
        if name.endswith("x1t"):
            tag += " (colocated on 1 torch thread: 1 core; disaggregated uses 2)"
        print(f"{tag}: P99 TPOT disaggregated / {name} = {ratio['tpot_p99']:.2f}; "
              f"throughput disaggregated / {name} = {ratio['throughput']:.2f}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (other work on the machine "
          f"adds noise)")
    if args.json:
        print(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "json"}, "burst_at_s": burst_at_s,
                          "load_avg_before": load_before, "load_avg_after": load_after,
                          "systems": results, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
