"""Preemption: taking a running group's KV blocks back so that others can run.

The scheduler decides *when* (the pool has no block left for the running groups' tokens, or,
under the priority policy, a better request waits); this module owns *how*: a victim's
sequences are swapped out to the CPU pool (their blocks come back with them later) or freed to
be recomputed from their tokens, and the group moves to ``swapped`` or ``waiting``. Apart from
:mod:`jaxllm.engine.scheduler` because it is the one place a group leaves ``running`` before it
finishes, with its own policy (which mode, which victim) and warnings. Plain Python, no ``jax``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jaxllm.engine.scheduler_output import SchedulerOutput
from jaxllm.engine.sequence import SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from jaxllm.engine.scheduler import Scheduler

# The scheduler's logger, as before this module was split out of it: log filters keep working.
logger = logging.getLogger("jaxllm.engine.scheduler")


def preempt(scheduler: Scheduler, group: SequenceGroup, out: SchedulerOutput) -> None:
    """Preempts a running group: by recompute for a single sequence, by swap for a parallel-
    sampling group (``preemption_mode`` overrides either; swap falls back to recompute when
    the CPU pool is full). The group leaves ``running``; its swap-out copies go into ``out``."""
    seqs = group.seqs_with_status(SequenceStatus.RUNNING)
    mode = scheduler.config.preemption_mode or ("recompute" if len(seqs) == 1 else "swap")
    ids = [s.seq_id for s in seqs]
    block_manager = scheduler.block_manager
    if mode == "swap" and not block_manager.can_swap_out(ids):
        logger.warning("request %s: no swap space left (increase --swap-space); "
                       "preempting by recompute instead", group.request_id)
        mode = "recompute"
    scheduler.running.remove(group)
    if mode == "swap":
        out.blocks_to_swap_out.extend(block_manager.swap_out(ids))
        for seq in seqs:
            seq.status = SequenceStatus.SWAPPED
        scheduler.swapped.append(group)
    else:
        for seq in seqs:
            block_manager.free(seq.seq_id)
            seq.reset_for_recompute()
        scheduler.waiting.append(group)
    group.num_preemptions += 1
    scheduler.num_preemptions += 1
    out.preempted.append(group)
    logger.warning(
        "request %s preempted by %s: not enough KV cache space (total preemptions %d); "
        "increase --gpu-memory-utilization or lower --max-num-seqs", group.request_id,
        mode, scheduler.num_preemptions)


def preempt_for_priority(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Under the priority policy: preempts the running groups that rank below the best waiting
    request, worst first, until its first chunk fits (blocks and ``max_num_seqs``)."""
    running, key = scheduler.running, scheduler.policy_key
    if not scheduler.waiting or not running:
        return
    head = min(scheduler.waiting, key=key)
    first_chunk = min(head.seqs[0].num_tokens, scheduler.config.max_num_batched_tokens)
    needed_blocks = -(-first_chunk // scheduler.block_size) * len(head.unfinished_seqs())
    needed_seqs = max(head.params.n, len(head.unfinished_seqs()))
    running.sort(key=key)
    while running and key(running[-1]) > key(head):
        fits_blocks = scheduler.block_manager.num_free_blocks >= needed_blocks
        fits_seqs = scheduler.num_seqs(running) + needed_seqs <= scheduler.config.max_num_seqs
        if fits_blocks and fits_seqs:
            return
        preempt(scheduler, running[-1], out)
