"""Serving metrics with vLLM's definitions (``benchmarks/benchmark_serving.py``), as pure
functions of per-request timelines, a Prometheus text parser for ``/metrics``, and the offline
benchmark's token-count check (:func:`check_output_tokens`).

For one request sent at ``start`` whose output tokens arrive at ``t_1 <= ... <= t_k``
(chunk arrival times; a chunk may carry several tokens):

    TTFT = t_1 - start                      (first chunk with a token)
    ITL  = [t_2 - t_1, ..., t_k - t_(k-1)]  (gaps between chunks)
    E2EL = t_k - start                      (when the stream ends)
    TPOT = (E2EL - TTFT) / (output_tokens - 1), only for requests with output_tokens > 1

Over a run of ``duration`` seconds: request throughput = completed / duration, output
throughput = sum(output tokens) / duration, total token throughput = (input + output) / duration.
Statistics are over successful requests; percentiles are numpy's (linear interpolation); ITL
statistics pool the gaps of all requests, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT (excl. 1st token)", "itl": "ITL",
                "e2el": "E2EL"}


class TokenCountError(ValueError):
    """A backend produced a different number of output tokens than the workload asked for."""


def check_output_tokens(backend: str, produced: int, requested: int) -> int:
    """``produced`` (counted from what the backend returned) when it is what the workload asked
    for; with ``ignore_eos`` every request generates exactly its output length, so any other
    count means the backend did other work than the others and its figures would not compare."""
    if produced != requested:
        raise TokenCountError(
            f"{backend} produced {produced} output tokens but the workload asked for {requested} "
            f"(ignore_eos, fixed output lengths): its throughput would not count what happened")
    return produced


@dataclasses.dataclass
class RequestTrace:
    """What the client saw of one request. Times in seconds (monotonic clock)."""

    prompt_len: int
    start: float = 0.0
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0  # E2EL
    error: str = ""

    def token_times(self) -> list[float]:
        """Absolute arrival time of every chunk (first one at start + ttft)."""
        if not self.success or self.output_tokens == 0:
            return []
        return list(self.start + self.ttft + np.concatenate([[0.0], np.cumsum(self.itl)]))


def tpot(trace: RequestTrace) -> float | None:
    if trace.output_tokens <= 1:
        return None
    return (trace.latency - trace.ttft) / (trace.output_tokens - 1)


def stats(values: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean, median, std and each percentile of ``values`` (0 for every key when empty)."""
    arr = np.asarray(values, dtype=np.float64)
    out = {"mean": 0.0, "median": 0.0, "std": 0.0} | {f"p{_pct(p)}": 0.0 for p in percentiles}
    if arr.size:
        out.update(mean=float(arr.mean()), median=float(np.median(arr)), std=float(arr.std()))
        for p in percentiles:
            out[f"p{_pct(p)}"] = float(np.percentile(arr, p))
    return out


def _pct(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def summarize(traces: list[RequestTrace], duration: float,
              percentiles: tuple[float, ...] = (50, 90, 99)) -> dict:
    """The result dict of ``bench serve``, with vLLM's JSON keys (``mean_ttft_ms`` ...)."""
    if duration <= 0:
        raise ValueError(f"duration={duration} must be > 0")
    ok = [t for t in traces if t.success]
    input_tokens = sum(t.prompt_len for t in ok)
    output_tokens = sum(t.output_tokens for t in ok)
    result = {
        "completed": len(ok),
        "failed": len(traces) - len(ok),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    per_metric = {
        "ttft": [t.ttft for t in ok],
        "tpot": [v for v in map(tpot, ok) if v is not None],
        "itl": [gap for t in ok for gap in t.itl],
        "e2el": [t.latency for t in ok],
    }
    for name, values in per_metric.items():
        for key, value in stats(values, percentiles).items():
            result[f"{key}_{name}_ms"] = 1e3 * value
    return result


def throughput_over_time(traces: list[RequestTrace], origin: float, bin_s: float = 1.0
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Output chunks per second in ``bin_s`` bins from ``origin``: (bin starts, rate)."""
    times = np.asarray([t - origin for tr in traces for t in tr.token_times()])
    if times.size == 0:
        return np.zeros(0), np.zeros(0)
    counts = np.bincount((np.maximum(times, 0.0) // bin_s).astype(np.int64))
    return bin_s * np.arange(len(counts)), counts / bin_s


def parse_prometheus(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` and ``{"name": sum over label sets}`` from exposition text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            series, value = line.rsplit(None, 1)
            number = float(value)
        except ValueError:
            continue
        if math.isnan(number):
            continue
        out[series] = number
        name = series.split("{", 1)[0]
        if name != series:
            out[name] = out.get(name, 0.0) + number
    return out


def print_summary(title: str, result: dict, percentiles: tuple[float, ...] = (50, 90, 99)
                  ) -> None:
    """vLLM's printed block."""
    line = lambda label, value, fmt="{:<10.2f}": print(f"{label:<40}" + fmt.format(value))
    print(f"{' ' + title + ' ':=^50}")
    line("Successful requests:", result["completed"], "{:<10}")
    line("Failed requests:", result["failed"], "{:<10}")
    line("Benchmark duration (s):", result["duration"])
    line("Total input tokens:", result["total_input_tokens"], "{:<10}")
    line("Total generated tokens:", result["total_output_tokens"], "{:<10}")
    line("Request throughput (req/s):", result["request_throughput"])
    line("Output token throughput (tok/s):", result["output_throughput"])
    line("Total Token throughput (tok/s):", result["total_token_throughput"])
    for name in LATENCY_METRICS:
        label = METRIC_NAMES[name]
        print(f"{' ' + label + ' ':-^50}")
        line(f"Mean {label.split()[0]} (ms):", result[f"mean_{name}_ms"])
        line(f"Median {label.split()[0]} (ms):", result[f"median_{name}_ms"])
        for p in percentiles:
            line(f"P{_pct(p)} {label.split()[0]} (ms):", result[f"p{_pct(p)}_{name}_ms"])
    extra = [(k, result[k]) for k in ("peak_kv_cache_usage_perc", "num_preemptions")
             if result.get(k) is not None]
    if extra:
        print("-" * 50)
        for k, v in extra:
            line(f"{k}:", v, "{:<10.4g}")
    print("=" * 50)
