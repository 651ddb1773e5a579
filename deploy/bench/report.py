"""Text and JSON output of `tandem bench` (bench process): the result table, results.json and
the side-by-side comparison of two results.json files."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from deploy.bench.metrics import LATENCY_METRICS, PERCENTILES
from deploy.bench.record import RequestRecord

_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
_WIDTH = 50


def _line(label: str, value) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label + ':':<40}{value:>10}"


def render(summary: dict) -> str:
    """The table `vllm bench serve` prints, plus failures and goodput."""
    lines = [" Serving Benchmark Result ".center(_WIDTH, "="),
             _line("Successful requests", summary["completed"]),
             _line("Failed requests", summary["failed"]),
             _line("Benchmark duration (s)", summary["duration_s"]),
             _line("Total input tokens", summary["total_input_tokens"]),
             _line("Total generated tokens", summary["total_output_tokens"]),
             _line("Request throughput (req/s)", summary["request_throughput"])]
    if summary.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s)", summary["request_goodput"]))
    lines += [_line("Output token throughput (tok/s)", summary["output_throughput"]),
              _line("Total token throughput (tok/s)", summary["total_token_throughput"])]
    for name in LATENCY_METRICS:
        lines.append(f" {_NAMES[name]} ".center(_WIDTH, "-"))
        lines.append(_line(f"Mean {name.upper()} (ms)", summary[f"mean_{name}_ms"]))
        lines.append(_line(f"Median {name.upper()} (ms)", summary[f"median_{name}_ms"]))
        for p in PERCENTILES:
            lines.append(_line(f"P{p} {name.upper()} (ms)", summary[f"p{p}_{name}_ms"]))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def write_results(path: Path, config: dict, summary: dict, records: Sequence[RequestRecord]) -> None:
    data = {"config": config, "summary": summary, "requests": [r.to_json() for r in records]}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def read_summary(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read results file {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("summary"), dict):
        # a bad input file, reported like every other CLI input error
        raise ValueError(f"{path} is not a `tandem bench` results.json (no 'summary' object)")  # noqa: TRY004
    return data["summary"]


def ratio(a, b) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or a == 0:
        return None
    return b / a


def compare(path_a: str | Path, path_b: str | Path) -> str:
    """Every summary metric of run A next to run B, with B/A."""
    a, b = read_summary(path_a), read_summary(path_b)
    keys = [k for k in a if k in b] + [k for k in b if k not in a]
    lines = [f"{'metric':<28}{'A':>14}{'B':>14}{'B/A':>9}", f"{'':<28}{str(path_a)[-13:]:>14}{str(path_b)[-13:]:>14}"]

    def fmt(v: object) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    for key in keys:
        va, vb = a.get(key), b.get(key)
        r = ratio(va, vb)
        lines.append(f"{key:<28}{fmt(va):>14}{fmt(vb):>14}{'n/a' if r is None else f'{r:.3f}':>9}")
    return "\n".join(lines)
