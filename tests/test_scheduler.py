"""Scheduler decisions against a mock runner whose outputs can be worked out by hand.

The mock "model" samples token ``1000 + number of tokens so far``; block ids follow from the
block manager handing out free blocks in ascending order.
"""

from __future__ import annotations

import pytest

from jaxllm.engine.block_manager import BlockManager
from jaxllm.engine.engine_config import SchedulerConfig
from jaxllm.engine.scheduler import RequestRejectedError, Scheduler
from jaxllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from jaxllm.sampling_params import SamplingParams

BS = 4
_ids = iter(range(10**6))


def make_scheduler(num_blocks=16, max_tokens=8, max_seqs=4, max_len=32, policy="fcfs",
                   preemption_mode=None, cpu_blocks=16):
    bm = BlockManager(num_blocks, BS, num_cpu_blocks=cpu_blocks)
    return Scheduler(SchedulerConfig(max_seqs, max_tokens, max_len, policy, preemption_mode),
                     bm)


def request(sched, name, prompt_len, *, arrival, priority=0, n=1, max_tokens=100):
    params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, max_tokens=max_tokens)
    seq = Sequence(next(_ids), list(range(prompt_len)), 0, seed=1)
    group = SequenceGroup(name, [seq], params, arrival_time=arrival, priority=priority)
    sched.add(group)
    return group


def step(sched):
    """schedule() + the mock model: append one token per sample row."""
    out = sched.schedule()
    for row in out.sample_rows:
        row.seq.token_ids.append(1000 + row.seq.num_tokens)
    return out


def plan(out):
    return [(s.seq.seq_id, s.start, s.num_new_tokens, out.block_table(i))
            for i, s in enumerate(out.scheduled)]


def test_chunked_prefill_mixes_with_decode_and_hands_out_exact_blocks():
    sched = make_scheduler()
    a = request(sched, "a", 10, arrival=0)
    b = request(sched, "b", 3, arrival=1)
    sa, sb = a.seqs[0].seq_id, b.seqs[0].seq_id
    out = step(sched)  # budget 8: a's first chunk only
    assert plan(out) == [(sa, 0, 8, [1, 2])] and not out.sample_rows
    out = step(sched)  # a finishes its prompt (2 tokens), b's whole prompt (3)
    assert plan(out) == [(sa, 8, 2, [1, 2, 3]), (sb, 0, 3, [4])]
    assert [r.seq.seq_id for r in out.sample_rows] == [sa, sb]
    out = step(sched)  # both decode one token
    assert plan(out) == [(sa, 10, 1, [1, 2, 3]), (sb, 3, 1, [4])]
    assert a.seqs[0].token_ids[10:] == [1010, 1011]


def test_budget_caps_tokens_and_sequences():
    sched = make_scheduler(max_tokens=8, max_seqs=2)
    groups = [request(sched, f"r{i}", 2, arrival=i) for i in range(3)]
    out = step(sched)
    assert [s.seq for s in out.scheduled] == [groups[0].seqs[0], groups[1].seqs[0]]
    assert [g.request_id for g in sched.waiting] == ["r2"]


def test_fcfs_admits_in_arrival_order_and_head_of_line_blocks():
    sched = make_scheduler(num_blocks=4, max_tokens=64, max_len=12)  # 3 usable blocks
    request(sched, "big", 9, arrival=0)  # needs 3 blocks
    request(sched, "small", 1, arrival=1)
    out = step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [sched.running[0].seqs[0].seq_id]
    assert [g.request_id for g in sched.waiting] == ["small"]  # no block left for it


def test_priority_policy_orders_by_priority_then_arrival():
    sched = make_scheduler(policy="priority", max_seqs=1, max_tokens=64)
    groups = [request(sched, "late-important", 2, arrival=5, priority=0),
              request(sched, "early-unimportant", 2, arrival=1, priority=3),
              request(sched, "early-important", 2, arrival=2, priority=0)]
    owner = {g.seqs[0].seq_id: g.request_id for g in groups}
    order = []
    for _ in range(3):
        out = step(sched)
        order.append(owner[out.scheduled[0].seq.seq_id])
        for row in out.sample_rows:
            sched.finish_seq(row.seq, SequenceStatus.FINISHED_LENGTH)
        sched.pop_finished()
    assert order == ["early-important", "late-important", "early-unimportant"]


def test_priority_preemption_evicts_worse_running_request():
    sched = make_scheduler(num_blocks=4, max_tokens=64, policy="priority", max_len=12)
    low = request(sched, "low", 8, arrival=0, priority=5)  # takes 2 of 3 blocks (+1 to grow)
    step(sched)
    step(sched)
    assert low.seqs[0].status == SequenceStatus.RUNNING
    high = request(sched, "high", 8, arrival=1, priority=0)
    out = step(sched)
    assert out.preempted == [low] and low.seqs[0].status == SequenceStatus.WAITING
    assert [s.seq for s in out.scheduled] == [high.seqs[0]]
    assert sched.num_preemptions == 1
    assert sched.block_manager.block_table(low.seqs[0].seq_id) == []


def test_running_out_of_blocks_preempts_the_newest_request_by_recompute():
    sched = make_scheduler(num_blocks=5, max_tokens=64, max_len=16)  # 4 usable blocks
    a = request(sched, "a", 7, arrival=0)
    b = request(sched, "b", 7, arrival=1)
    step(sched)  # prompts: a -> [1, 2], b -> [3, 4]; both sample token 7
    step(sched)  # position 7 still fits the second block of each
    out = step(sched)  # position 8 needs a third block each: none free -> b (newest) goes
    assert out.preempted == [b]
    # b freed [3, 4] in reverse order (tail first), so a gets block 4.
    assert plan(out) == [(a.seqs[0].seq_id, 8, 1, [1, 2, 4])]
    assert b.seqs[0].status == SequenceStatus.WAITING and b.seqs[0].num_computed_tokens == 0
    assert b.seqs[0].token_ids[7:] == [1007, 1008]  # generated tokens survive the recompute
    assert sched.num_preemptions == 1


def test_the_request_being_scheduled_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=5, max_tokens=64, max_len=16)  # 4 usable blocks
    a = request(sched, "a", 4, arrival=0)
    b = request(sched, "b", 7, arrival=1)
    step(sched)  # a -> [1], b -> [2, 3]
    step(sched)  # a's position 4 takes block 4; b's position 7 fits block 3
    out = step(sched)  # b's position 8 needs a block; b is the lowest-ranked: it goes itself
    assert out.preempted == [b] and [s.seq for s in out.scheduled] == [a.seqs[0]]
    assert b.seqs[0].status == SequenceStatus.WAITING


def test_pool_smaller_than_one_max_length_sequence_is_refused():
    with pytest.raises(ValueError, match="max_model_len=64 needs 16 blocks"):
        make_scheduler(num_blocks=3, max_len=64)


def test_parallel_sampling_forks_then_swaps_out_as_a_group():
    sched = make_scheduler(num_blocks=6, max_tokens=64, cpu_blocks=8, max_len=20)
    g = request(sched, "n3", 6, arrival=0, n=3)
    out = step(sched)
    parent = g.seqs[0]
    assert len(g.seqs) == 3 and [r.source for r in out.sample_rows] == [parent] * 3
    bm = sched.block_manager
    assert all(bm.block_table(s.seq_id) == [1, 2] for s in g.seqs)  # shared prompt blocks
    out = step(sched)  # each child writes into shared block 2: copy-on-write for two of them
    assert len(out.blocks_to_copy) == 2 and all(src == 2 for src, _ in out.blocks_to_copy)
    for _ in range(4):  # three sequences outgrow 5 blocks; the group swaps out whole
        out = step(sched)
        if out.preempted:
            break
    assert out.preempted == [g] and not out.scheduled
    distinct = {gpu for gpu, _ in out.blocks_to_swap_out}
    # Tables [1, 2], [1, 3], [1, 4]: the shared block 1 is copied once, 4 copies not 6.
    assert len(out.blocks_to_swap_out) == len(distinct) == 4 and 1 in distinct
    assert all(s.status == SequenceStatus.SWAPPED for s in g.seqs) and sched.swapped == [g]
    # It can never fit whole again: with nothing running, its sequences are recomputed one by
    # one rather than waiting forever.
    out = step(sched)
    assert sched.swapped == [] and sched.running == [g] and len(out.scheduled) >= 1
    for _ in range(40):
        for row in step(sched).sample_rows:
            if row.seq.num_tokens >= 14:
                sched.finish_seq(row.seq, SequenceStatus.FINISHED_LENGTH)
        if sched.pop_finished():
            break
    assert g.is_finished and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 5
    sched.block_manager.check_invariants()


def test_requests_that_can_never_fit_are_rejected_at_once():
    sched = make_scheduler(num_blocks=17, max_len=64)
    with pytest.raises(RequestRejectedError, match="too long and exceeds limit of 63"):
        request(sched, "long", 64, arrival=0)
    with pytest.raises(RequestRejectedError, match="at least one token"):
        request(sched, "empty", 0, arrival=0)
    assert not sched.has_unfinished()


def test_abort_frees_everything():
    sched = make_scheduler()
    a = request(sched, "a", 10, arrival=0)
    request(sched, "b", 3, arrival=1)
    step(sched)
    assert sched.abort("a") is a and a.seqs[0].status == SequenceStatus.FINISHED_ABORTED
    assert sched.abort("b") is not None and sched.abort("zzz") is None
    assert sched.block_manager.num_free_blocks == 15
    sched.block_manager.check_invariants()
