"""Randomised engine runs: requests arrive, get aborted, get preempted, fork and finish in every
order, with async scheduling on; nothing is lost, nothing leaks, greedy outputs stay exact."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import (  # noqa: F401
    BLOCK,
    CFG,
    SMALL_POOL,
    assert_no_leak,
    make_engine,
    model,
    reference,
)

from jaxllm.engine.sequence import SequenceStatus
from jaxllm.sampling_params import SamplingParams


@pytest.mark.parametrize("seed, policy, mode", [(0, "fcfs", None), (1, "priority", None),
                                                (2, "fcfs", "recompute"), (3, "priority", "swap")])
def test_random_arrivals_aborts_and_preemptions(model, seed, policy, mode):  # noqa: F811
    rng = np.random.default_rng(seed)
    engine = make_engine(model, **SMALL_POOL, scheduling_policy=policy, preemption_mode=mode,
                         swap_space=0.01, enable_prefix_caching=bool(seed % 2))
    submitted: dict[str, tuple] = {}
    finished: dict[str, object] = {}
    aborted: set[str] = set()
    next_id = 0
    for _ in range(300):
        if next_id < 40 and rng.random() < 0.6:
            rid = str(next_id)
            next_id += 1
            prompt = rng.integers(0, CFG.vocab_size, int(rng.integers(1, 60))).tolist()
            if rng.random() < 0.3:  # shared prefixes exercise the prefix cache
                prompt = list(range(2 * BLOCK)) + prompt[:20]
            greedy = rng.random() < 0.6
            params = SamplingParams(
                n=1 if greedy else int(rng.integers(1, 4)), temperature=0 if greedy else 1.0,
                seed=int(rng.integers(1000)), max_tokens=int(rng.integers(1, 20)),
                ignore_eos=True)
            priority = int(rng.integers(0, 3)) if policy == "priority" else 0
            engine.add_request(rid, prompt_token_ids=prompt, params=params, priority=priority)
            submitted[rid] = (prompt, params)
        if submitted and rng.random() < 0.05:
            rid = str(rng.integers(0, next_id))
            if rid not in finished and rid not in aborted:
                for out in engine.abort_request(rid):
                    assert out.finished and out.request_id == rid
                    aborted.add(rid)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "a request finished twice"
                finished[out.request_id] = out
        # The KV accounting's one sum over the block tables: every table is a running seq's.
        bm = engine.block_manager
        assert bm.num_table_blocks() == sum(
            bm.num_blocks(s.seq_id) for g in engine.scheduler.running for s in g.seqs
            if s.status is SequenceStatus.RUNNING)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out
    assert set(finished) | aborted == set(submitted)
    assert not set(finished) & aborted
    for rid, out in finished.items():
        prompt, params = submitted[rid]
        assert len(out.outputs) == params.n
        for choice in out.outputs:
            assert choice.finish_reason == "length"
            assert len(choice.token_ids) == params.max_tokens
            assert all(0 <= t < CFG.vocab_size for t in choice.token_ids)
        if params.temperature == 0:
            assert out.outputs[0].token_ids == reference(tuple(prompt), params.max_tokens)
    assert_no_leak(engine)
    # The run really exercised what it claims to.
    assert aborted and engine.scheduler.num_preemptions > 0, (aborted,
                                                             engine.scheduler.num_preemptions)
    assert any(p.n > 1 for _, p in submitted.values())
