"""What the engine's state is between two steps, read on the engine's own thread (in-process)
or in the engine-core process, and sent to the HTTP front end for ``/metrics``, the stats log
line and the memory monitor."""

from __future__ import annotations

import dataclasses
import os
import time

import jax

from jaxllm.engine.device_memory import DeviceMemory, device_memory
from jaxllm.engine.kv_usage import engine_usage, paged_step
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.sequence import SequenceStatus


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
    # bytes, where the platform reports it (device_memory.py: this process's allocations, or
    # under an allocator that keeps no statistics the whole device's, from the CUDA driver)
    device_memory_used: int | None = None
    device_memory_limit: int | None = None
    host_rss_bytes: int | None = None  # the engine's process


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """Runs where the engine steps, between two steps."""
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
        device_memory_used=None if memory is None else memory.in_use,
        device_memory_limit=None if memory is None else memory.limit,
        host_rss_bytes=host_rss_bytes())


def merge_snapshots(snapshots: list[EngineSnapshot]) -> EngineSnapshot:
    """The total over data-parallel replicas: counts, seconds and bytes summed; usage shares
    over the pooled blocks (each replica's weighted by its blocks; the waste by its blocks in
    use, the slots it is a share of); the time of the newest."""
    if len(snapshots) == 1:
        return snapshots[0]

    def total(name: str) -> float:
        return sum(getattr(s, name) for s in snapshots)

    def weighted(name: str, weights: list[float]) -> float:
        return sum(getattr(s, name) * w for s, w in zip(snapshots, weights, strict=True)) / (
            sum(weights) or 1)

    def known_sum(name: str) -> int | None:
        values = [getattr(s, name) for s in snapshots if getattr(s, name) is not None]
        return sum(values) if values else None

    blocks = [s.num_gpu_blocks or 1 for s in snapshots]
    in_use = [s.kv_pool_utilisation * b for s, b in zip(snapshots, blocks, strict=True)]
    fields = {f.name: total(f.name) for f in dataclasses.fields(EngineSnapshot)
              if f.type in ("int", "float")}
    fields.update(
        time=max(s.time for s in snapshots), kv_usage=weighted("kv_usage", blocks),
        cpu_kv_usage=total("cpu_kv_usage") / len(snapshots),  # swap spaces are the same size
        kv_waste=weighted("kv_waste", in_use),
        kv_pool_utilisation=weighted("kv_pool_utilisation", blocks),
        **{name: known_sum(name) for name in ("device_memory_used", "device_memory_limit",
                                              "host_rss_bytes")})
    return EngineSnapshot(**fields)


def _device_memory() -> DeviceMemory | None:
    try:
        return device_memory(jax.local_devices()[0])
    except Exception:  # noqa: BLE001 - backends without memory stats
        return None


def host_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def unfinished_request_ids(engine: LLMEngine, request_ids: set[str]) -> list[str]:
    """Those of ``request_ids`` the engine still runs (waiting, running or swapped); a request
    that has finished but whose last output its consumer has not read yet is not one."""
    scheduler = engine.scheduler
    return [group.request_id for queue in (scheduler.waiting, scheduler.running, scheduler.swapped)
            for group in queue if group.request_id in request_ids]
