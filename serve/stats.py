"""Engine state read between steps (on the engine thread), the periodic stats log line, and
the memory monitor with its leak watch (``JAXLLM_MEMORY_MONITOR=1``)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import time

import jax

from jaxllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from jaxllm.engine.kv_usage import engine_usage, paged_step
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.sequence import SequenceStatus

logger = logging.getLogger("serve.stats")
SNAPSHOT_TIMEOUT = 5.0  # seconds to wait for the engine thread; then reuse the last snapshot


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    time: float  # time.monotonic()
    running: int = 0  # requests (sequence groups) per queue
    waiting: int = 0
    swapped: int = 0
    kv_usage: float = 0.0  # fraction of usable GPU blocks in use
    cpu_kv_usage: float = 0.0
    # jaxllm.engine.kv_usage's definitions, now (this snapshot) and summed over the engine's steps
    kv_waste: float = 0.0  # of the slots in running sequences' blocks, the share with no token
    kv_pool_utilisation: float = 0.0  # those slots over the pool's usable slots
    kv_slots_reserved: int = 0  # since start, summed over steps
    kv_slots_used: int = 0
    num_free_blocks: int = 0
    num_gpu_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0
    host_seconds: float = 0.0
    device_seconds: float = 0.0
    prompt_tokens: int = 0  # computed by the engine (recomputation after preemption included)
    generation_tokens: int = 0
    device_memory_used: int | None = None  # bytes, where the platform reports it
    device_memory_limit: int | None = None


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """Runs on the engine thread (``run_in_engine``): the engine is between steps."""
    scheduler, bm, stats = engine.scheduler, engine.block_manager, engine.stats
    running = [seq for group in scheduler.running
               for seq in group.seqs_with_status(SequenceStatus.RUNNING)]
    now = paged_step([bm.num_blocks(seq.seq_id) for seq in running],
                     [seq.num_computed_tokens for seq in running], bm.block_size,
                     bm.num_gpu_blocks - 1)
    total = engine_usage(stats)
    memory = _device_memory()
    return EngineSnapshot(
        time=time.monotonic(), running=len(scheduler.running), waiting=len(scheduler.waiting),
        swapped=len(scheduler.swapped), kv_usage=bm.usage, cpu_kv_usage=bm.cpu_usage,
        kv_waste=now.waste or 0.0, kv_pool_utilisation=now.utilisation or 0.0,
        kv_slots_reserved=total.reserved, kv_slots_used=total.used,
        num_free_blocks=bm.num_free_blocks, num_gpu_blocks=bm.num_gpu_blocks,
        num_preemptions=scheduler.num_preemptions,
        prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
        steps=stats.num_steps, host_seconds=getattr(stats, "host_seconds", 0.0),
        device_seconds=getattr(stats, "device_wait_seconds",
                               getattr(stats, "device_seconds", 0.0)),
        prompt_tokens=stats.prompt_tokens, generation_tokens=stats.generation_tokens,
        device_memory_used=memory.get("bytes_in_use"),
        device_memory_limit=memory.get("bytes_limit"))


def _device_memory() -> dict:
    try:
        return jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        return {}


class SnapshotCache:
    """The latest engine snapshot; ``refresh()`` asks the engine thread for a new one and keeps
    the old one when the engine is dead or busy past the timeout."""

    def __init__(self, engine: AsyncLLMEngine):
        self.engine = engine
        self.latest = EngineSnapshot(time=time.monotonic())

    async def refresh(self) -> EngineSnapshot:
        if self.engine.dead_error is None:
            try:
                self.latest = await asyncio.wait_for(
                    self.engine.run_in_engine(take_snapshot), SNAPSHOT_TIMEOUT)
            except (EngineDeadError, TimeoutError):
                pass
            except Exception:  # a bug here must not take /metrics or the log line down
                logger.exception("reading engine stats failed")
        return self.latest


def host_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


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
    """Samples host RSS and device memory every ``interval`` seconds, with a leak watch each."""

    def __init__(self, snapshots: SnapshotCache, interval: float):
        self.snapshots = snapshots
        self.interval = interval
        self.host_rss: int | None = None
        self.watches = {"host RSS": LeakWatch("host RSS"),
                        "device memory": LeakWatch("device memory")}

    async def run(self) -> None:
        while True:
            self.sample((await self.snapshots.refresh()).device_memory_used)
            await asyncio.sleep(self.interval)

    def sample(self, device_bytes: int | None) -> None:
        self.host_rss = host_rss_bytes()
        if self.host_rss is not None:
            self.watches["host RSS"].add(self.host_rss)
        if device_bytes is not None:
            self.watches["device memory"].add(device_bytes)
