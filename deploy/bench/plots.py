"""PNG pictures of one `tandem bench` run (matplotlib, Agg backend; bench process, after the run).

- latency_cdf.png: empirical CDFs of TTFT, TPOT and E2E latency of completed requests.
- tokens_per_s.png: output tokens/s over the run; a request's output tokens are spread evenly
  over its content chunks, binned by chunk arrival.
- ttft_vs_prompt_len.png: one dot per completed request.
Every figure is ``PLOT_SIZE_PX`` pixels (fixed size and dpi, no tight bbox), so reports line up.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from deploy.bench.metrics import request_tpot_s
from deploy.bench.record import RequestRecord

DPI = 100
PLOT_SIZE_PX = (1000, 600)
PLOT_FILES = ("latency_cdf.png", "tokens_per_s.png", "ttft_vs_prompt_len.png")
_MAX_BINS = 60


def _figure(plt, ncols: int = 1):
    return plt.subplots(1, ncols, figsize=(PLOT_SIZE_PX[0] / DPI, PLOT_SIZE_PX[1] / DPI), dpi=DPI,
                        layout="constrained")


def _cdf(ax, values_ms: Sequence[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if not len(values_ms):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    x = np.sort(np.asarray(values_ms))
    ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post")
    for p, style in ((50, ":"), (99, "--")):
        ax.axvline(np.percentile(x, p), color="gray", linestyle=style, label=f"p{p}")
    ax.legend(loc="lower right")


def _latency_cdfs(plt, done: Sequence[RequestRecord], path: Path) -> None:
    fig, axes = _figure(plt, 3)
    _cdf(axes[0], [r.ttft_s * 1e3 for r in done], "TTFT")
    _cdf(axes[1], [t * 1e3 for t in map(request_tpot_s, done) if t is not None], "TPOT")
    _cdf(axes[2], [r.e2e_s * 1e3 for r in done], "E2E latency")
    axes[0].set_ylabel("fraction of requests")
    fig.savefig(path)
    plt.close(fig)


def _tokens_per_s(plt, done: Sequence[RequestRecord], duration_s: float, path: Path) -> None:
    fig, ax = _figure(plt)
    times, weights = [], []
    for r in done:
        chunk_times = r.chunk_times_s()
        times += chunk_times
        weights += [r.output_len / len(chunk_times)] * len(chunk_times)
    num_bins = max(1, min(_MAX_BINS, int(np.ceil(duration_s / 0.1))))
    edges = np.linspace(0.0, max(duration_s, max(times, default=0.0)), num_bins + 1)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    width_s = edges[1] - edges[0] if edges[-1] > 0 else 1.0
    ax.plot((edges[:-1] + edges[1:]) / 2, counts / width_s, drawstyle="steps-mid")
    ax.set_title(f"output tokens/s over time (bins of {width_s:.3g} s)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    fig.savefig(path)
    plt.close(fig)


def _ttft_vs_prompt_len(plt, done: Sequence[RequestRecord], path: Path) -> None:
    fig, ax = _figure(plt)
    ax.scatter([r.prompt_len for r in done], [r.ttft_s * 1e3 for r in done], s=10, alpha=0.6)
    ax.set_title("TTFT vs prompt length")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    fig.savefig(path)
    plt.close(fig)


def write_plots(records: Sequence[RequestRecord], duration_s: float, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if r.success]
    paths = [out_dir / name for name in PLOT_FILES]
    _latency_cdfs(plt, done, paths[0])
    _tokens_per_s(plt, done, duration_s, paths[1])
    _ttft_vs_prompt_len(plt, done, paths[2])
    return paths
