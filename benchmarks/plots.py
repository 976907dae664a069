"""PNG plots for the benchmark results (matplotlib, no display needed)."""

from __future__ import annotations

import numpy as np
from jaxllm.benchmarks.metrics import RequestTrace, throughput_over_time, tpot


def _cdf(ax, values, label: str) -> None:
    values = np.sort(np.asarray(values, dtype=np.float64)) * 1e3
    if values.size:
        ax.plot(values, np.arange(1, values.size + 1) / values.size)
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests" if label != "ITL" else "fraction of gaps")
    ax.grid(alpha=0.3)


def plot_serve(traces: list[RequestTrace], origin: float, path: str, title: str = "") -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2EL) and output throughput over time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [t for t in traces if t.success]
    fig, axes = plt.subplots(1, 5, figsize=(22, 4))
    _cdf(axes[0], [t.ttft for t in ok], "TTFT")
    _cdf(axes[1], [v for v in map(tpot, ok) if v is not None], "TPOT")
    _cdf(axes[2], [g for t in ok for g in t.itl], "ITL")
    _cdf(axes[3], [t.latency for t in ok], "E2EL")
    seconds, rate = throughput_over_time(ok, origin)
    axes[4].step(seconds, rate, where="post")
    axes[4].set_xlabel("time since start (s)")
    axes[4].set_ylabel("output chunks/s (~tokens/s)")
    axes[4].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_bars(results: dict[str, dict], key: str, path: str, title: str = "") -> None:
    """One bar per backend of ``results[backend][key]`` (e.g. output tokens/s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 3.5))
    ax.bar(names, [results[n][key] for n in names])
    ax.set_ylabel(key)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
