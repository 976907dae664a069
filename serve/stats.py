"""The engine snapshot as the front end keeps it, the periodic stats log line, and the memory
monitor with its leak watch (``JAXLLM_MEMORY_MONITOR=1``)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from jaxllm.engine.engine_client import EngineClient, EngineDeadError
from jaxllm.engine.snapshot import EngineSnapshot, host_rss_bytes, merge_snapshots

logger = logging.getLogger("serve.stats")
SNAPSHOT_TIMEOUT = 5.0  # seconds to wait for the engine; then reuse the last snapshot


class SnapshotCache:
    """The latest engine snapshot; ``refresh()`` asks the engine for a new one (taken between
    two steps) and keeps the old one when the engine is dead or busy past the timeout.
    ``latest`` is the total over data-parallel replicas, ``per_engine`` each one's."""

    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.latest = EngineSnapshot(time=time.monotonic())
        self.per_engine: list[EngineSnapshot] = [self.latest]

    async def refresh(self) -> EngineSnapshot:
        if self.engine.dead_error is None:
            try:
                per_engine = await asyncio.wait_for(self.engine.snapshots(), SNAPSHOT_TIMEOUT)
                self.per_engine, self.latest = per_engine, merge_snapshots(per_engine)
            except (EngineDeadError, TimeoutError):
                pass
            except Exception:  # a bug here must not take /metrics or the log line down
                logger.exception("reading engine stats failed")
        return self.latest


class LeakWatch:
    """Flags steady growth: ``window`` samples, each at least the one before, adding up to more
    than ``min_growth`` bytes (and ``min_fraction`` of the first). Warns once per window."""

    def __init__(self, name: str, window: int = 12, min_growth: int = 64 << 20,
                 min_fraction: float = 0.02):
        self.name = name
        self.samples: collections.deque[int] = collections.deque(maxlen=window)
        self.min_growth = min_growth
        self.min_fraction = min_fraction
        self._quiet = 0  # samples to wait before warning again

    def add(self, value: int) -> bool:
        """Adds a sample; returns True (and logs a warning) when it looks like a leak."""
        self.samples.append(value)
        self._quiet = max(0, self._quiet - 1)
        if len(self.samples) < self.samples.maxlen or self._quiet:
            return False
        values = list(self.samples)
        growth = values[-1] - values[0]
        steady = all(b >= a for a, b in zip(values, values[1:], strict=False))
        if steady and growth > max(self.min_growth, self.min_fraction * values[0]):
            logger.warning("%s grew steadily by %.1f MiB over the last %d samples (%.1f -> "
                           "%.1f MiB): possible leak", self.name, growth / 2**20, len(values),
                           values[0] / 2**20, values[-1] / 2**20)
            self._quiet = len(values)
            return True
        return False


class StatsLogger:
    """Every ``interval`` seconds: vLLM's throughput / queue / KV line (when anything moved)."""

    def __init__(self, snapshots: SnapshotCache, interval: float):
        self.snapshots = snapshots
        self.interval = interval
        self._last: EngineSnapshot | None = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.log(await self.snapshots.refresh())

    def log(self, now: EngineSnapshot) -> None:
        last, self._last = self._last, now
        if last is None or now.time <= last.time:
            return
        dt = now.time - last.time
        moved = (now.steps != last.steps or now.running or now.waiting or now.swapped)
        if moved:
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                "tokens/s, Running: %d reqs, Swapped: %d reqs, Pending: %d reqs, GPU KV cache "
                "usage: %.1f%%, CPU KV cache usage: %.1f%%.",
                (now.prompt_tokens - last.prompt_tokens) / dt,
                (now.generation_tokens - last.generation_tokens) / dt, now.running,
                now.swapped, now.waiting, 100 * now.kv_usage, 100 * now.cpu_kv_usage)


class MemoryMonitor:
    """Samples host RSS (this process's, and the engine-core process's when the engine runs in
    its own) and device memory every ``interval`` seconds, with a leak watch each."""

    def __init__(self, snapshots: SnapshotCache, interval: float):
        self.snapshots = snapshots
        self.interval = interval
        self.host_rss: int | None = None
        self.engine_rss: int | None = None  # None while the engine shares this process
        self.watches = {"host RSS": LeakWatch("host RSS"),
                        "engine host RSS": LeakWatch("engine host RSS"),
                        "device memory": LeakWatch("device memory")}

    async def run(self) -> None:
        while True:
            self.sample(await self.snapshots.refresh())
            await asyncio.sleep(self.interval)

    def sample(self, snapshot: EngineSnapshot) -> None:
        self.host_rss = host_rss_bytes()
        if self.host_rss is not None:
            self.watches["host RSS"].add(self.host_rss)
        if self.snapshots.engine.out_of_process and snapshot.host_rss_bytes is not None:
            self.engine_rss = snapshot.host_rss_bytes
            self.watches["engine host RSS"].add(self.engine_rss)
        if snapshot.device_memory_used is not None:
            self.watches["device memory"].add(snapshot.device_memory_used)
