"""KV-cache waste and pool utilisation: one definition for the engine, the server and every
backend of ``bench throughput`` (plain Python, no jax import).

Each step (an engine step, or a decode step of a static batch) adds what its KV cache holds::

    reserved  slots set aside for the running sequences' K/V
                paged (jaxllm):        blocks in their block tables x block_size
                contiguous (static):   the whole allocated cache, rows x capacity, for the
                                       batch's lifetime (padding rows and slots included)
                HF dynamic cache:      rows x the current padded length (it grows by one a step)
    used      slots holding a real token: prompt or generated, no padding, none past the
              output length the request asked for
    capacity  slots the pool could hand out: paged, the usable blocks x block_size; a
              contiguous cache is allocated per batch, so its capacity is what it reserves

Over a run (time-averaged over steps)::

    waste        = 1 - sum(used) / sum(reserved)
    utilisation  = sum(reserved) / sum(capacity)

So a paged pool's utilisation says how much of it running sequences held (its waste is only the
unfilled tail of their last blocks); a static or dynamic contiguous cache's utilisation is 1 by
construction (everything allocated is reserved) and its waste is the figure to read. A block
shared by several sequences (prefix cache, ``n > 1``) counts once per sequence, on both sides.

    block_size 4, a sequence of 6 tokens holding 2 blocks:
    [t t t t] [t t . .]   reserved 8, used 6
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass
class KVUsage:
    """Slots summed over steps; ``waste`` and ``utilisation`` are None before any reservation."""

    reserved: int = 0
    used: int = 0
    capacity: int = 0
    steps: int = 0

    def add(self, reserved: int, used: int, capacity: int, steps: int = 1) -> None:
        if not 0 <= used <= reserved:
            raise ValueError(f"need 0 <= {used=} <= {reserved=}")
        self.reserved += reserved
        self.used += used
        self.capacity += capacity
        self.steps += steps

    def __add__(self, other: KVUsage) -> KVUsage:
        return KVUsage(self.reserved + other.reserved, self.used + other.used,
                       self.capacity + other.capacity, self.steps + other.steps)

    def __sub__(self, other: KVUsage) -> KVUsage:
        """What was added since ``other`` (an earlier reading of the same counters)."""
        return KVUsage(self.reserved - other.reserved, self.used - other.used,
                       self.capacity - other.capacity, self.steps - other.steps)

    @property
    def waste(self) -> float | None:
        return 1.0 - self.used / self.reserved if self.reserved else None

    @property
    def utilisation(self) -> float | None:
        return self.reserved / self.capacity if self.capacity else None

    def as_dict(self) -> dict:
        """The JSON keys of ``bench throughput``."""
        return {"kv_waste": self.waste, "kv_pool_utilisation": self.utilisation,
                "kv_slots_reserved": self.reserved, "kv_slots_used": self.used,
                "kv_slots_capacity": self.capacity, "kv_steps": self.steps}


def paged_step(blocks_held: Iterable[int], tokens: Iterable[int], block_size: int,
               usable_blocks: int) -> KVUsage:
    """One step of a paged pool: each running sequence's block count and token count (tokens
    whose K/V is in the pool)."""
    return KVUsage(block_size * sum(blocks_held), sum(tokens), block_size * usable_blocks, 1)


def engine_usage(stats) -> KVUsage:
    """The engine's counters (``EngineStats``: ``kv_slots_*`` summed over its steps)."""
    return KVUsage(stats.kv_slots_reserved, stats.kv_slots_used, stats.kv_slots_capacity,
                   stats.num_steps)


def _sum_min(steps: int, limit: int) -> int:
    """sum(min(s, limit) for s in 1..steps), in closed form."""
    if limit >= steps:
        return steps * (steps + 1) // 2
    return limit * (limit + 1) // 2 + limit * (steps - limit)


def contiguous_batch(prompt_lens: Iterable[int], output_lens: Iterable[int], steps: int, *,
                     rows: int, width: int, cache_len: int | None) -> KVUsage:
    """A static batch run for ``steps`` decode steps: real rows with these prompt and requested
    output lengths (their K/V after step s: prompt + min(s, output) tokens); ``rows`` rows in the
    cache (padding rows included), prompts padded to ``width``. ``cache_len``: the slots each row
    owns for the whole batch (a static / contiguous cache); None for HF's dynamic cache, which
    holds ``width + s`` slots a row after step s."""
    prompt_lens, output_lens = list(prompt_lens), list(output_lens)
    if len(prompt_lens) != len(output_lens) or len(prompt_lens) > rows:
        raise ValueError(f"{len(prompt_lens)} prompts, {len(output_lens)} outputs, {rows=}")
    used = steps * sum(prompt_lens) + sum(_sum_min(steps, o) for o in output_lens)
    if cache_len is None:
        reserved = rows * (steps * width + steps * (steps + 1) // 2)
    else:
        reserved = rows * cache_len * steps
    return KVUsage(reserved, used, reserved, steps)
