"""Prometheus metrics, ``jaxllm:`` prefix, vLLM's names where the meaning matches.

Request metrics (tokens, latencies, finish reasons, HTTP statuses) are counted here as requests
end, so they match what clients were sent; engine state (queues, KV usage, preemptions, device
memory) is read from an :class:`~serve.stats.EngineSnapshot` at scrape time. One registry per
app, so several servers can live in one process (tests).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from jaxllm.serve.stats import MemoryMonitor, SnapshotCache
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from jaxllm.engine.outputs import RequestOutput
from jaxllm.engine.snapshot import EngineSnapshot

TTFT_BUCKETS = (.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5, 7.5, 10)
TPOT_BUCKETS = (.01, .025, .05, .075, .1, .15, .2, .3, .4, .5, .75, 1, 2.5)
E2E_BUCKETS = (.3, .5, .8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60)


def _one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class Metrics:
    def __init__(self, model_name: str, max_model_len: int, engine_info: dict[str, str],
                 snapshots: SnapshotCache, memory: MemoryMonitor | None = None):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        name = ["model_name"]
        info = Info("jaxllm:cache_config", "KV cache and engine settings", registry=r)
        info.info(engine_info)
        self.http = Counter("jaxllm:http_requests", "HTTP responses by route, method and status "
                            "code (499: client went away)", ["handler", "method", "status"],
                            registry=r)
        self.success = Counter("jaxllm:request_success", "Finished sequences by finish reason",
                               name + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("jaxllm:prompt_tokens", "Prompt tokens of finished "
                                     "requests", name, registry=r).labels(model_name)
        self.generation_tokens = Counter("jaxllm:generation_tokens", "Generated tokens of "
                                         "finished requests", name, registry=r).labels(model_name)
        self.ttft = Histogram("jaxllm:time_to_first_token_seconds", "Arrival to first token",
                              name, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("jaxllm:time_per_output_token_seconds", "Time between output "
                              "tokens", name, buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("jaxllm:e2e_request_latency_seconds", "Arrival to last token",
                             name, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        token_buckets = _one_two_five(max_model_len)
        self.request_prompt = Histogram("jaxllm:request_prompt_tokens", "Prompt tokens per "
                                        "request", name, buckets=token_buckets,
                                        registry=r).labels(model_name)
        self.request_generation = Histogram("jaxllm:request_generation_tokens", "Generated "
                                            "tokens per request", name, buckets=token_buckets,
                                            registry=r).labels(model_name)
        self.request_n = Histogram("jaxllm:request_params_n", "The n parameter", name,
                                   buckets=(1, 2, 5, 10, 20), registry=r).labels(model_name)
        engine = _EngineCollector(model_name, snapshots, memory)
        r.register(engine)
        self.export = r
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Several front-end processes (--api-server-count): counters and histograms are
            # kept in files there by every process, and summed here; the engine's state and
            # the settings are the same in each, so this process's are exported.
            self.export = CollectorRegistry()
            MultiProcessCollector(self.export)
            self.export.register(info)
            self.export.register(engine)

    def render(self) -> bytes:
        return generate_latest(self.export)

    def tracker(self, arrival: float, n: int) -> RequestTracker:
        return RequestTracker(self, arrival, n)


class RequestTracker:
    """Timings and token counts of one engine request, fed with each RequestOutput."""

    def __init__(self, metrics: Metrics, arrival: float, n: int):
        self.metrics = metrics
        self.arrival = arrival
        self.n = n
        self.first_token: float | None = None
        self.last_time = arrival
        self.last_tokens = 0  # tokens of the longest sample so far
        self.output: RequestOutput | None = None  # the newest (delta) output
        self.num_tokens: dict[int, int] = {}  # sample index -> output tokens so far
        self.finish_reasons: dict[int, str | None] = {}
        self._done = False

    def update(self, output: RequestOutput) -> None:
        """Counts one delta output (``RequestOutputKind.DELTA``: only the new tokens)."""
        now = time.monotonic()
        self.output = output
        counts = self.num_tokens
        for o in output.outputs:
            counts[o.index] = counts.get(o.index, 0) + len(o.token_ids)
            self.finish_reasons[o.index] = o.finish_reason
        tokens = max(counts.values(), default=0)
        if tokens > self.last_tokens:
            if self.first_token is None:
                self.first_token = now
                self.metrics.ttft.observe(now - self.arrival)
                new = tokens - 1
            else:
                new = tokens - self.last_tokens
            if new:
                self.metrics.tpot.observe((now - self.last_time) / new)
            self.last_tokens, self.last_time = tokens, now

    def discard(self) -> None:
        """The engine refused the request: it is not counted."""
        self._done = True

    def finish(self) -> None:
        """Counts the request once, whether it finished, failed or was aborted."""
        if self._done:
            return
        self._done = True
        m, out = self.metrics, self.output
        m.request_n.observe(self.n)
        if out is None:
            m.success.labels(m.model_name, "abort").inc(self.n)
            return
        generated = sum(self.num_tokens.values())
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(generated)
        m.request_prompt.observe(len(out.prompt_token_ids))
        m.request_generation.observe(generated)
        m.e2e.observe(time.monotonic() - self.arrival)
        reasons = [reason or "abort" for reason in self.finish_reasons.values()]
        reasons += ["abort"] * (self.n - len(reasons))
        for reason in reasons:
            m.success.labels(m.model_name, reason).inc()


class _EngineCollector(Collector):
    """Engine state at scrape time, from the snapshot the /metrics handler just refreshed."""

    def __init__(self, model_name: str, snapshots: SnapshotCache,
                 memory: MemoryMonitor | None):
        self.model_name = model_name
        self.snapshots = snapshots
        self.memory = memory

    def collect(self) -> Iterator[Metric]:
        s = self.snapshots.latest
        alive = self.snapshots.engine.dead_error is None
        gauges = [
            ("num_requests_running", "Requests running on the device", s.running),
            ("num_requests_waiting", "Requests waiting to be scheduled", s.waiting),
            ("num_requests_swapped", "Requests swapped out to host memory", s.swapped),
            ("kv_cache_usage_perc", "KV cache usage (1 = 100%)", s.kv_usage),
            ("gpu_cache_usage_perc", "KV cache usage (1 = 100%); vLLM V0's name", s.kv_usage),
            ("cpu_cache_usage_perc", "Swap space usage (1 = 100%)", s.cpu_kv_usage),
            ("kv_cache_waste_perc", "Share of the KV slots in running sequences' blocks that "
                                    "hold no token (1 = 100%)", s.kv_waste),
            ("kv_cache_pool_utilisation_perc", "KV slots in running sequences' blocks over the "
                                               "pool's usable slots (1 = 100%)",
             s.kv_pool_utilisation),
            ("num_free_gpu_blocks", "Allocatable KV blocks (free or evictable)",
             s.num_free_blocks),
            ("engine_healthy", "1 while the engine loop runs, 0 after a failed step",
             int(alive)),
        ]
        if s.device_memory_used is not None:
            gauges.append(("device_memory_used_bytes", "Device memory in use",
                           s.device_memory_used))
        if s.device_memory_limit is not None:
            gauges.append(("device_memory_limit_bytes", "Device memory the runtime may use",
                           s.device_memory_limit))
        if self.memory is not None and self.memory.host_rss is not None:
            gauges.append(("host_rss_bytes", "Host resident memory of this server process "
                           "(memory monitor sample)", self.memory.host_rss))
        if self.memory is not None and self.memory.engine_rss is not None:
            gauges.append(("engine_host_rss_bytes", "Host resident memory of the engine-core "
                           "process (memory monitor sample)", self.memory.engine_rss))
        for name, doc, value in gauges:
            family = GaugeMetricFamily(f"jaxllm:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        counters = [
            ("num_preemptions", "Preemptions (recompute or swap)", s.num_preemptions),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache",
             s.prefix_cache_hits),
            ("engine_steps", "Engine steps run", s.steps),
            ("kv_slots_reserved", "KV slots in running sequences' blocks, summed over steps "
                                  "(run-averaged waste = 1 - rate(used) / rate(reserved))",
             s.kv_slots_reserved),
            ("kv_slots_used", "KV slots holding a token, summed over steps", s.kv_slots_used),
            ("engine_device_seconds", "Seconds the engine waited for the device (rate() = "
                                      "device busy share)", s.device_seconds),
            ("engine_host_seconds", "Seconds the engine spent scheduling and dispatching",
             s.host_seconds),
        ]
        for name, doc, value in counters:
            family = CounterMetricFamily(f"jaxllm:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        if len(self.snapshots.per_engine) > 1:
            yield from self._per_engine(self.snapshots.per_engine)

    def _per_engine(self, snapshots: list[EngineSnapshot]) -> Iterator[Metric]:
        """Each data-parallel replica's state, labelled ``engine`` (as vLLM labels them); the
        families above are the totals."""
        gauges = [
            ("num_requests_running", "Requests running on the device", "running"),
            ("num_requests_waiting", "Requests waiting to be scheduled", "waiting"),
            ("num_requests_swapped", "Requests swapped out to host memory", "swapped"),
            ("kv_cache_usage_perc", "KV cache usage (1 = 100%)", "kv_usage"),
            ("num_free_gpu_blocks", "Allocatable KV blocks (free or evictable)",
             "num_free_blocks"),
        ]
        counters = [
            ("engine_steps", "Engine steps run", "steps"),
            ("engine_prompt_tokens", "Prompt tokens computed (recomputation included)",
             "prompt_tokens"),
            ("engine_generation_tokens", "Tokens generated", "generation_tokens"),
        ]
        for kinds, family_type in ((gauges, GaugeMetricFamily), (counters, CounterMetricFamily)):
            for name, doc, field in kinds:
                family = family_type(f"jaxllm:{name}_per_engine", doc + ", per engine",
                                     labels=["model_name", "engine"])
                for engine, s in enumerate(snapshots):
                    family.add_metric([self.model_name, str(engine)], getattr(s, field))
                yield family
