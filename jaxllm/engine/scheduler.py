"""Continuous-batching scheduler: plain Python, no ``jax``.

Queues hold :class:`SequenceGroup` s: ``waiting`` (new or preempted by recompute), ``running``
and ``swapped`` (KV blocks parked in host memory). ``schedule()`` decides, each step, how many
tokens of which sequences the model computes, and which KV blocks move or get copied first.
How a group is preempted when blocks run out is :mod:`jaxllm.engine.preemption`'s.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

from jaxllm.engine.block_manager import BlockManager
from jaxllm.engine.engine_config import SchedulerConfig
from jaxllm.engine.preemption import preempt, preempt_for_priority
from jaxllm.engine.scheduler_output import ScheduledSample, ScheduledSeq, SchedulerOutput
from jaxllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["RequestRejectedError", "ScheduledSample", "ScheduledSeq", "Scheduler",
           "SchedulerOutput"]


@dataclasses.dataclass
class _Budget:
    tokens: int
    seqs: int


class RequestRejectedError(ValueError):
    """A request that can never be scheduled (too long for the model or the KV pool)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 seq_ids: Callable[[], int] | None = None):
        self.config = config
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        needed = -(-config.max_model_len // self.block_size)
        if needed > block_manager.num_gpu_blocks - 1:
            raise ValueError(
                f"max_model_len={config.max_model_len} needs {needed} blocks of "
                f"{self.block_size} tokens but the KV pool has "
                f"{block_manager.num_gpu_blocks - 1}: one sequence could never finish")
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0
        self._next_seq_id = seq_ids or itertools.count(1_000_000_000).__next__
        self._order = itertools.count()  # tie-breaker: admission order
        self._keys: dict[str, tuple] = {}
        self._finished: list[SequenceGroup] = []  # finished, not yet popped
        # Sequences finished since the last collection, and each sequence's group: a step
        # looks at the groups whose sequences finished, not at every group.
        self._finishing: list[Sequence] = []
        self._group_of: dict[int, SequenceGroup] = {}
        self._running_sorted = True  # running is in policy order (policy_key)
        # A decoding sequence's sample row, the same every step: seq id -> ScheduledSample.
        self._samples: dict[int, ScheduledSample] = {}

    # ------------------------------------------------------------------ queues
    def add(self, group: SequenceGroup) -> None:
        """Queues a request, or raises RequestRejectedError if it can never run."""
        prompt_len = len(group.prompt_token_ids)
        limit = self.config.max_model_len
        if prompt_len == 0:
            raise RequestRejectedError("the prompt must contain at least one token")
        if prompt_len >= limit:
            raise RequestRejectedError(
                f"Input prompt ({prompt_len} tokens) is too long and exceeds limit of "
                f"{limit - 1} (max_model_len={limit})")
        if group.params.n > self.config.max_num_seqs:
            raise RequestRejectedError(
                f"n={group.params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if self.config.policy == "priority":
            key = (group.priority, group.arrival_time, next(self._order))
        else:
            key = (group.arrival_time, next(self._order))
        self._keys[group.request_id] = key
        self._group_of.update((seq.seq_id, group) for seq in group.seqs)
        self.waiting.append(group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.unfinished_seqs():
                        self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
                    self._keys.pop(request_id, None)
                    for seq in group.seqs:
                        self._group_of.pop(seq.seq_id, None)
                    return group
        return None

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        self.block_manager.free(seq.seq_id)
        self._samples.pop(seq.seq_id, None)
        seq.status = status
        self._finishing.append(seq)

    def pop_finished(self) -> list[SequenceGroup]:
        """Removes and returns groups whose every sequence has finished."""
        self._collect_finished()
        done, self._finished = self._finished, []
        for group in done:
            self._keys.pop(group.request_id, None)
            for seq in group.seqs:
                self._group_of.pop(seq.seq_id, None)
        return done

    def _collect_finished(self) -> None:
        if not self._finishing:
            return
        groups = (self._group_of.get(seq.seq_id) for seq in self._finishing)
        done = {id(g) for g in groups if g is not None and g.is_finished}
        self._finishing = []
        # Waiting or swapped groups finish too when a token sampled before their
        # preemption turns out to be their last.
        for name in ("running", "waiting", "swapped") if done else ():
            queue = getattr(self, name)
            if any(id(g) in done for g in queue):
                self._finished += [g for g in queue if id(g) in done]
                setattr(self, name, [g for g in queue if id(g) not in done])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._finished)

    def num_seqs(self, queue: list[SequenceGroup]) -> int:
        return sum(len(g.unfinished_seqs()) for g in queue)

    def policy_key(self, group: SequenceGroup) -> tuple:
        """The group's place in policy order: ((priority,) arrival time, admission order)."""
        return self._keys[group.request_id]

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """One step's work.

        The rule: every sequence has ``num_computed_tokens`` catching up with its token count;
        there are no prefill or decode phases. In policy order (fcfs: arrival; priority:
        (priority, arrival)), running sequences first get their missing tokens (1 when
        decoding, a chunk of a long prompt otherwise) within ``max_num_batched_tokens``; when
        the pool has no block left, the lowest-priority running group is preempted (recompute
        for a single sequence, swap for a parallel-sampling group, or ``preemption_mode``),
        possibly the group being scheduled. Only if nobody was preempted, swapped groups and
        then waiting groups are admitted in policy order (priority: one merged order) until
        the token budget, ``max_num_seqs`` or free blocks run out; the first that does not fit
        stops admission, so nobody overtakes. Under ``priority``, running groups that rank
        below the best waiting request are first preempted until it fits.
        Scheduled tokens count as computed at once (``num_computed_tokens`` advances here).
        """
        out = SchedulerOutput()
        self._collect_finished()  # finished groups are never preemption victims
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        if self.config.policy == "priority":
            preempt_for_priority(self, out)
        if not self._running_sorted:  # keys never change: only admissions unsort it
            self.running.sort(key=self.policy_key)
            self._running_sorted = True
        preempted_before = len(out.preempted)
        self._schedule_all_running(budget, out)
        if len(out.preempted) == preempted_before:
            self._admit(budget, out)
        out.block_tables, out.num_blocks = self.block_manager.block_tables(
            [item.seq.seq_id for item in out.scheduled])
        return out

    def _schedule_running(self, group: SequenceGroup, budget: _Budget,
                          out: SchedulerOutput) -> bool:
        """Schedules a running group's missing tokens. False if the group itself was
        preempted (it has left ``running``)."""
        planned: list[tuple[Sequence, int]] = []
        tokens, seqs = budget.tokens, budget.seqs
        for seq in group.seqs_with_status(SequenceStatus.RUNNING):
            if seq.pending and seq.reached_output_limit:
                continue  # its last token is being sampled: it finishes when that arrives
            num_new = min(seq.num_uncomputed_tokens, tokens)
            if num_new == 0 or seqs == 0:
                break
            planned.append((seq, num_new))
            tokens, seqs = tokens - num_new, seqs - 1
        # Make room for the whole group before allocating anything: a group preempted after
        # some of its sequences were allocated would leave prefix-cache entries for blocks
        # that never got written.
        needed = self._blocks_needed(planned, shared=len(group.seqs) > 1)
        while needed > self.block_manager.num_free_blocks:
            victim = self.running[-1]
            preempt(self, victim, out)
            if victim is group:
                return False
        for seq, num_new in planned:
            copies = self.block_manager.allocate_slots(
                seq.seq_id, seq.token_ids, seq.num_computed_tokens, num_new,
                num_cacheable_tokens=seq.num_known_tokens)
            if copies is None:  # cached-block accounting made the estimate optimistic
                self._unschedule(group, budget, out)
                preempt(self, group, out)
                self.block_manager.reset_prefix_cache()  # drop hashes of unwritten blocks
                return False
            self._commit(group, seq, num_new, copies, budget, out)
        for seq in group.seqs_with_status(SequenceStatus.WAITING):
            if not self._admit_seq(group, seq, budget, out):
                break
        return True

    def _schedule_all_running(self, budget: _Budget, out: SchedulerOutput) -> None:
        """``_schedule_running`` for each running group in order (which may preempt, removing
        groups), with its commonest case inline as it runs for every sequence every step: a
        lone running sequence one token behind (a decode)."""
        running, bs, samples = self.running, self.block_size, self._samples
        # A token inside the sequence's own last block needs nothing from the block manager
        # (allocate_slots returns [] unchanged) unless a block becomes full for the prefix
        # cache (register_at): the block holds this sequence's earlier tokens, so it is
        # neither a cache hit nor shared (n = 1).
        caching = self.block_manager.enable_prefix_caching
        register_at = self.block_manager.register_at
        schedule_one, running_status = out.scheduled.append, SequenceStatus.RUNNING
        index = 0
        while index < len(running):
            group = running[index]
            seq = group.seqs[0]
            if len(group.seqs) == 1 and group.params.n == 1 and seq.status is running_status:
                tokens, computed = seq.token_ids, seq.num_computed_tokens
                if seq.pending and (len(tokens) - len(seq.prompt_token_ids)
                                    >= seq.output_limit):
                    index += 1  # its last token is being sampled: it finishes then
                    continue
                if len(tokens) == computed + 1 and budget.tokens and budget.seqs and (
                        (computed % bs and (not caching or len(tokens) - len(seq.pending)
                                            < register_at.get(seq.seq_id, 0)))
                        or self._decode_slot(seq, out)):
                    schedule_one(ScheduledSeq(seq, computed, 1))
                    seq.num_computed_tokens = computed + 1
                    budget.tokens -= 1
                    budget.seqs -= 1
                    row = samples.get(seq.seq_id)
                    if row is None:  # (seq, seq, group) never changes: made once
                        row = samples[seq.seq_id] = ScheduledSample(seq, seq, group)
                    out.sample_rows.append(row)
                    index += 1
                    continue
            if self._schedule_running(group, budget, out):
                index += 1

    def _decode_slot(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """A decode's slot; False, changing nothing, if it needs a preemption first."""
        bm, tokens, computed = self.block_manager, seq.token_ids, seq.num_computed_tokens
        if computed % self.block_size == 0 and not bm.num_free_blocks:
            return False
        copies = bm.allocate_slots(seq.seq_id, tokens, computed, 1,
                                   num_cacheable_tokens=len(tokens) - len(seq.pending))
        out.blocks_to_copy.extend(copies or ())
        return copies is not None

    def _blocks_needed(self, planned: list[tuple[Sequence, int]], shared: bool) -> int:
        """Upper bound of new blocks (one copy-on-write block each when blocks are shared)."""
        needed = 0
        for seq, num_new in planned:
            have = self.block_manager.num_blocks(seq.seq_id)
            blocks = -(-(seq.num_computed_tokens + num_new) // self.block_size)
            needed += max(0, blocks - have) + (1 if shared else 0)
        return needed

    def _admit(self, budget: _Budget, out: SchedulerOutput) -> None:
        if self.config.policy == "priority":
            candidates = sorted(self.swapped + self.waiting, key=self.policy_key)
        else:
            candidates = (sorted(self.swapped, key=self.policy_key)
                          + sorted(self.waiting, key=self.policy_key))
        for group in candidates:
            if budget.tokens == 0:
                return
            if group in self.swapped:
                if self._swap_in(group, budget, out):
                    continue
                if self.running or out.scheduled:
                    return
                # Nothing runs and the group still does not fit as a whole: recompute its
                # sequences one by one instead of waiting for space that will never free up.
                self._swapped_to_waiting(group)
                if not self._admit_waiting(group, budget, out):
                    return
            elif not self._admit_waiting(group, budget, out):
                return

    def _swap_in(self, group: SequenceGroup, budget: _Budget, out: SchedulerOutput) -> bool:
        seqs = group.seqs_with_status(SequenceStatus.SWAPPED)
        ids = [s.seq_id for s in seqs]
        if len(seqs) > budget.seqs or len(seqs) > budget.tokens:
            return False
        # Room for the swapped blocks plus one new block per sequence, so that scheduling
        # it right after never preempts (a swap-out after a swap-in in one step would read
        # blocks not yet written).
        worst_case = sum(-(-s.num_tokens // self.block_size) + 1 for s in seqs)
        if worst_case > self.block_manager.num_free_blocks:
            return False
        if not self.block_manager.can_swap_in(ids):
            return False
        out.blocks_to_swap_in.extend(self.block_manager.swap_in(ids))
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        self.swapped.remove(group)
        self.running.append(group)
        self._running_sorted = False
        self._schedule_running(group, budget, out)
        return True

    def _admit_waiting(self, group: SequenceGroup, budget: _Budget,
                       out: SchedulerOutput) -> bool:
        """Admits a waiting group (its sequences one by one, as blocks allow; the rest are
        admitted in later steps while the group runs). False if none fit."""
        seqs = group.seqs_with_status(SequenceStatus.WAITING)
        seq_cost = group.params.n if group.needs_fork else 1
        if seq_cost > budget.seqs or not self._admit_seq(group, seqs[0], budget, out):
            return False
        self.waiting.remove(group)
        self.running.append(group)
        self._running_sorted = False
        for seq in seqs[1:]:
            if not self._admit_seq(group, seq, budget, out):
                break
        return True

    def _admit_seq(self, group: SequenceGroup, seq: Sequence, budget: _Budget,
                   out: SchedulerOutput) -> bool:
        if budget.seqs == 0 or budget.tokens == 0:
            return False
        cached_blocks, num_cached = ([], 0) if group.reads_every_position \
            else self.block_manager.lookup_prefix(seq.token_ids)
        num_new = min(seq.num_tokens - num_cached, budget.tokens)
        copies = self.block_manager.allocate_slots(seq.seq_id, seq.token_ids, num_cached,
                                                   num_new, cached_blocks,
                                                   num_cacheable_tokens=seq.num_known_tokens)
        if copies is None:
            return False
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = num_cached
        if group.metrics.first_scheduled_time is None:
            group.metrics.num_cached_tokens = num_cached
        self._commit(group, seq, num_new, copies, budget, out)
        return True

    def _swapped_to_waiting(self, group: SequenceGroup) -> None:
        for seq in group.seqs_with_status(SequenceStatus.SWAPPED):
            self.block_manager.free(seq.seq_id)
            seq.reset_for_recompute()
        self.swapped.remove(group)
        self.waiting.append(group)

    def _commit(self, group: SequenceGroup, seq: Sequence, num_new: int,
                copies: list[tuple[int, int]], budget: _Budget, out: SchedulerOutput) -> None:
        out.blocks_to_copy.extend(copies)
        if group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = time.monotonic()
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
        seq.num_computed_tokens += num_new
        budget.tokens -= num_new
        budget.seqs -= 1
        if seq.num_computed_tokens < seq.num_tokens:
            return  # a chunk of a longer prompt: no token to sample yet
        out.sample_rows.append(ScheduledSample(seq, seq, group))
        if group.needs_fork:
            for index in range(len(group.seqs), group.params.n):
                child = seq.fork(self._next_seq_id(), index, seed=seq.seed + index)
                self.block_manager.fork(seq.seq_id, child.seq_id)
                group.seqs.append(child)
                self._group_of[child.seq_id] = group
                out.sample_rows.append(ScheduledSample(child, seq, group))
                budget.seqs -= 1

    def _unschedule(self, group: SequenceGroup, budget: _Budget, out: SchedulerOutput) -> None:
        """Takes back what this step already gave ``group`` (it is about to be preempted)."""
        mine = {id(s) for s in group.seqs}
        for item in [s for s in out.scheduled if id(s.seq) in mine]:
            out.scheduled.remove(item)
            item.seq.num_computed_tokens = item.start
            budget.tokens += item.num_new_tokens
            budget.seqs += 1
        out.sample_rows = [r for r in out.sample_rows if id(r.seq) not in mine]
