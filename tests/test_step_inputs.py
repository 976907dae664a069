"""The engine's host path: a scheduled step packed without per-token Python (``pack_step``)
equals the reference builder fed one ``SeqChunk`` per sequence, placeholders included; the
packed one-buffer transfer unpacks to the same arrays, on the host and inside a jit; staged
(``JAXLLM_STAGE_STEP_INPUT``), the forward reads it in one op and computes the same."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.benchmarks.step_kernels import parameter_readers
from tiny_models import TINY_CONFIGS, random_params

from jaxllm.batch import PackedBatch, SeqChunk, pack_batch
from jaxllm.engine.block_manager import BlockManager
from jaxllm.engine.buckets import BucketSpec
from jaxllm.engine.engine_config import SchedulerConfig
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceGroup
from jaxllm.engine.step_inputs import pack_step
from jaxllm.engine.step_programs import ProgramKey, stage_step_input, step_programs
from jaxllm.kv_pool import new_kv_pool
from jaxllm.models.llama import unstack_layer_params
from jaxllm.sampling_params import SamplingParams

BS = 4


def _reference(out, buckets):
    """pack_step's result from the per-sequence builder (the engine's code before)."""
    chunks, prev = [], []
    for i, item in enumerate(out.scheduled):
        ids = item.seq.token_ids[item.start:item.start + item.num_new_tokens]
        chunks.append(SeqChunk(ids, item.start, out.block_table(i)))
        prev += [item.seq.pending.get(p, -1)
                 for p in range(item.start, item.start + item.num_new_tokens)]
    shape = buckets.shape_for(len(prev), len(chunks), len(out.sample_rows),
                              max(len(c.block_table) for c in chunks))
    rows = [next(i for i, s in enumerate(out.scheduled) if s.seq is r.source)
            for r in out.sample_rows]
    batch = pack_batch(chunks, BS, num_tokens=shape.num_tokens, num_seqs=shape.num_seqs,
                       table_width=shape.table_width, logits_rows=np.asarray(rows, np.int32),
                       num_logits=shape.num_seqs, decode_only=shape.is_decode)
    prev = np.asarray(prev + [-1] * (shape.num_tokens - len(prev)), np.int32)
    return batch, shape, prev if (prev >= 0).any() else None


def _check(out, buckets):
    got, shape, prev = pack_step(out, buckets, BS)
    want, want_shape, want_prev = _reference(out, buckets)
    assert shape == want_shape
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
                 "query_start_loc", "logits_indices"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert (prev is None) == (want_prev is None)
    if prev is not None:
        np.testing.assert_array_equal(prev, want_prev)
    return got, prev


def test_packed_steps_equal_the_per_sequence_builder_with_placeholders():
    """Chunked prompts beside decodes, then decode-only steps whose tokens are placeholders
    sampled by the step before (async scheduling), one sequence lagging a step behind."""
    bm = BlockManager(64, BS)
    sched = Scheduler(SchedulerConfig(8, 10, 64), bm)
    buckets = BucketSpec.build(8, 10, 16, bucket_table_width=True)
    for i, length in enumerate((3, 9, 6)):
        sched.add(SequenceGroup(f"r{i}", [Sequence(i, list(range(10, 10 + length)))],
                                SamplingParams(max_tokens=50)))
    mixed = decode = 0
    for step in range(12):
        out = sched.schedule()
        _, prev = _check(out, buckets)
        decode += all(s.num_new_tokens == 1 for s in out.scheduled)
        mixed += any(s.num_new_tokens > 1 for s in out.scheduled)
        if step > 2:
            assert prev is not None  # the placeholders this test is about
        for r, row in enumerate(out.sample_rows):
            seq = row.seq
            for pos in list(seq.pending):  # the step before's token arrives (lagging one)
                if step % 3 or seq.seq_id != 1:
                    seq.token_ids[pos] = 100 + pos
                    del seq.pending[pos]
            seq.pending[seq.num_tokens] = r
            seq.token_ids.append(PLACEHOLDER_TOKEN)
    assert mixed and decode
    bm.check_invariants()  # the numpy rows the tables came from match the block lists


def test_packed_batch_unpacks_to_its_fields_on_the_host_and_in_a_jit():
    batch = pack_batch([SeqChunk([5, 6, 7], 0, [3]), SeqChunk([8], 6, [1, 2])], BS,
                       num_tokens=8, num_seqs=4, table_width=4, num_logits=4)
    prev = np.array([-1, -1, 0, 1, -1, -1, -1, -1], np.int32)
    packed = PackedBatch.pack(batch, prev)
    unpacked = jax.jit(lambda p: p.unpack())(packed)
    for got, got_prev in (packed.unpack(), unpacked):
        np.testing.assert_array_equal(got_prev, prev)
        for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
                     "query_start_loc", "logits_indices"):
            np.testing.assert_array_equal(getattr(got, name), getattr(batch, name))


def test_a_traced_batch_equals_the_host_one_and_runs_no_while_loop():
    # generate() packs inside its jit: the token -> sequence search is unrolled (a while
    # loop would run from the host, outside the program's CUDA graph on a GPU)
    from jaxllm.batch import SeqChunks

    chunks = SeqChunks.from_list([SeqChunk([5, 6, 7], 4, [1, 2]), SeqChunk([8], 5, [3, 5]),
                                  SeqChunk([9, 10], 0, [4])])
    host = pack_batch(chunks, 4, num_tokens=8, num_seqs=4)
    arrays = (chunks.token_ids, chunks.num_new_tokens, chunks.num_computed, chunks.block_tables)
    traced = jax.jit(lambda *a: pack_batch(SeqChunks(*a), 4, num_tokens=8, num_seqs=4))
    device = traced(*arrays)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices"):
        np.testing.assert_array_equal(getattr(device, name), getattr(host, name), name)
    assert "stablehlo.while" not in traced.lower(*arrays).as_text()


@pytest.mark.parametrize("layers", ["stacked", "unrolled"])
def test_staged_step_input_is_read_by_one_op_and_changes_no_logit(layers):
    """``JAXLLM_STAGE_STEP_INPUT=on`` (ProgramKey.stage_input): the compiled forward reads
    its newly transferred batch in one op (the copy the rest read; on a GPU, the one command
    of the step's graph re-recorded for a new batch address), and computes what it computed
    before: a mixed step of a prompt chunk and a decode, its pool written the same."""
    cfg = TINY_CONFIGS["llama3_rope_scaling"]
    params = random_params(cfg)
    unroll = layers == "unrolled"
    if unroll:
        params = unstack_layer_params(params)
    chunks = [SeqChunk([5, 6, 7, 8, 9], 0, [1, 2]), SeqChunk([3], 6, [3, 4])]
    batch = pack_batch(chunks, BS, num_tokens=8, num_seqs=2, table_width=4, num_logits=2)
    packed = PackedBatch.pack(batch, np.full(8, -1, np.int32))
    prev_tokens = jnp.zeros((8,), jnp.int32)
    results, readers = [], []
    for stage in (False, True):
        programs = step_programs(ProgramKey(cfg, jnp.float32, "reference", None, 8, stage))
        pool = new_kv_pool(cfg, 8, BS, jnp.float32, unroll_layers=unroll)
        compiled = programs.forward.lower(params, pool, packed, prev_tokens).compile()
        number = len(jax.tree.leaves(params)) + len(jax.tree.leaves(pool))  # packed's data
        readers.append(parameter_readers(compiled.as_text(), number))
        logits, pool, _ = compiled(params, pool, packed, prev_tokens)
        results.append((np.asarray(logits), [np.asarray(x) for x in jax.tree.leaves(pool)]))
    assert readers[0] > 1 and readers[1] == 1, readers
    np.testing.assert_array_equal(results[1][0], results[0][0])
    for staged, plain in zip(results[1][1], results[0][1], strict=True):
        np.testing.assert_array_equal(staged, plain)


def test_stage_step_input_setting_refuses_other_values():
    assert not stage_step_input({}) and stage_step_input({"JAXLLM_STAGE_STEP_INPUT": "on"})
    with pytest.raises(ValueError, match="JAXLLM_STAGE_STEP_INPUT='yes' must be 'off' or 'on'"):
        stage_step_input({"JAXLLM_STAGE_STEP_INPUT": "yes"})
