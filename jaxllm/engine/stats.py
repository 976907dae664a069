"""The engine's counters since start (plain Python): tokens, host time per step phase, KV
slots; the server turns them into Prometheus metrics, the benchmarks into per-step phases."""

from __future__ import annotations

import dataclasses

from jaxllm.engine.block_manager import BlockManager
from jaxllm.engine.scheduler import SchedulerOutput
from jaxllm.engine.sequence import SequenceGroup, SequenceStatus


@dataclasses.dataclass
class EngineStats:
    """Counters since start; the server turns them into Prometheus metrics."""

    num_steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    # Host time per phase; output_seconds runs while the device computes (overlapped).
    schedule_seconds: float = 0.0
    prepare_seconds: float = 0.0  # block moves, packing, sampling metadata, dispatch
    output_seconds: float = 0.0  # detokenization, stop strings, RequestOutputs
    update_seconds: float = 0.0  # appending sampled tokens, EOS/length checks
    device_wait_seconds: float = 0.0  # blocked on the device after the overlapped work
    # Structured outputs: the engine thread waiting on the grammar task (starting it, within
    # update; its bitmask, within prepare), and the task itself (token accepts, then the
    # bitmask) on the bitmask thread, overlapped.
    bitmask_seconds: float = 0.0
    bitmask_fill_seconds: float = 0.0

    finished: dict = dataclasses.field(default_factory=dict)  # finish reason -> count
    # KV slots summed over steps (jaxllm.engine.kv_usage defines waste and utilisation from them)
    kv_slots_reserved: int = 0  # block-table slots of running sequences
    kv_slots_used: int = 0  # ... of which hold a token
    kv_slots_capacity: int = 0  # usable blocks x block_size

    @property
    def host_seconds(self) -> float:
        """Host time on the critical path (not overlapped with the device)."""
        return self.schedule_seconds + self.prepare_seconds + self.update_seconds

    def account(self, out: SchedulerOutput, num_embedded: int, block_manager: BlockManager,
                running: list[SequenceGroup]) -> None:
        """Counts one recorded step: its prompt and generated tokens, and the KV slots the
        running sequences reserve and fill."""
        # One pass each (no call per row): these run over every running sequence every step.
        self.prompt_tokens += sum([
            min(len(i.seq.prompt_token_ids), i.start + i.num_new_tokens) - i.start
            for i in out.scheduled if i.start < len(i.seq.prompt_token_ids)])
        self.generation_tokens += len(out.sample_rows) - num_embedded
        bm = block_manager
        self.kv_slots_capacity += (bm.num_gpu_blocks - 1) * bm.block_size  # block 0: null
        # Every GPU block table belongs to a running sequence: one sum over the manager's
        # numpy rows, not a Python call per sequence.
        self.kv_slots_reserved += bm.num_table_blocks() * bm.block_size
        self.kv_slots_used += sum([seq.num_computed_tokens for group in running
                                   for seq in group.seqs if seq.status is SequenceStatus.RUNNING])
