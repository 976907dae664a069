"""What ``Scheduler.schedule()`` hands the model runner for one step (plain Python and
numpy, no ``jax``): the chunks to compute, the rows to sample, the block moves and the
scheduled sequences' block tables."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxllm.engine.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    import numpy as np


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    """Compute tokens ``token_ids[start:start + num_new_tokens]`` of ``seq`` this step."""

    seq: Sequence
    start: int
    num_new_tokens: int


@dataclasses.dataclass(slots=True)
class ScheduledSample:
    """Sample one token for ``seq`` from the logits of ``source``'s last scheduled token
    (``source`` is ``seq`` itself, or the parent when a request forks into n samples)."""

    seq: Sequence
    source: Sequence
    group: SequenceGroup


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = dataclasses.field(default_factory=list)
    sample_rows: list[ScheduledSample] = dataclasses.field(default_factory=list)
    # Device-side block moves, applied in this order before the forward:
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted: list[SequenceGroup] = dataclasses.field(default_factory=list)
    # The scheduled seqs' GPU blocks, row i = scheduled[i] (one gather of the block manager's
    # numpy rows, taken when schedule() returns):
    block_tables: np.ndarray | None = None  # i32[C, W] null-padded, W = the longest table
    num_blocks: np.ndarray | None = None  # i32[C]

    def block_table(self, i: int) -> list[int]:
        """scheduled[i]'s block ids."""
        return self.block_tables[i, :self.num_blocks[i]].tolist()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out)
