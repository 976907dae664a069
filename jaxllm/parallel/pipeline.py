"""Pipeline parallelism: the layer stack split into ``pp`` stages, one per slice of the mesh's
``pp`` axis, with a step's tokens cut into micro-batches that flow through the stages.

Where things live (:mod:`jaxllm.parallel.sharding`): the stacked layer params [L, ...] and the
KV pool [L, blocks, block_size, Hkv, D] are split over ``pp`` on their layer axis, so stage s
holds layers s L/pp .. (s+1) L/pp - 1 and their pages (scanned in the stage); in the unrolled
layout, per-layer tree and pool array j hold layer j of every stage, [pp, ...], split the same
way, and each stage runs its L/pp layers as straight-line code. Embedding, final norm and LM
head are replicated over ``pp`` (split over ``tp`` as usual). The stage loop is one
``jax.shard_map`` over ``pp`` (``tp`` stays automatic inside it, so tensor parallelism within
a stage is unchanged), and activations pass stage to stage by ``jax.lax.ppermute``; nothing
else is communicated by hand (the last stage's hidden states reach the LM head by XLA's
resharding).

Schedule (GPipe, inside the jitted step): the step's T tokens are cut into M micro-batches of
T/M consecutive tokens, and the stage loop runs M + pp - 1 iterations; at iteration i stage s
works on micro-batch i - s, so with pp = 2, M = 4::

    iteration    0    1    2    3    4
    stage 0     mb0  mb1  mb2  mb3   .
    stage 1      .   mb0  mb1  mb2  mb3

A stage idles only in the fill and drain bubble, a fraction (pp - 1) / (M + pp - 1) of the
iterations (here 1/5). Idle iterations still run (the loop is SPMD), on a micro-batch whose
K/V writes are dropped. Cutting by tokens rather than by sequences keeps every micro-batch the
same static size however ragged the step is; a sequence cut between micro-batches stays
correct because micro-batch m reaches each stage after micro-batch m - 1 wrote its K/V
there, and each micro-batch's view of the metadata ends the sequence at its last token in it
(:func:`micro_batch`), so every attention backend sees its usual contract.

Why in-step micro-batches, not vLLM's pp batches in flight across engine steps: the engine's
async scheduling already keeps one step in flight, and the next step's inputs depend on this
step's sampled tokens; holding pp independent batches in flight would need the scheduler to
keep pp disjoint sets of running requests, which it does not. Inside one jitted step the
overlap needs no scheduler change and is the same program on CPU and GPU.

Cost model (what picks M, :func:`num_micro_batches`): a step is M + pp - 1 stage iterations,
and each reads its stage's weights once whatever its size. A memory-bound micro-batch (decode,
fewer tokens than the GPU's flop/byte balance) costs that read alone, so the step reads
(M + pp - 1) / pp of the model: 1.5x at M = pp = 2, where M = 1 reads it once (and overlaps
nothing). A compute-bound one costs its T / M tokens, so the step costs T (1 + (pp - 1) / M)
/ pp: more micro-batches, less bubble. Hence M = pp, the fewest that keep every stage busy
outside the bubble, and up to 4 pp while each keeps :data:`MIN_MICRO_BATCH_TOKENS`. Whether
M = 1 serves decode steps better is for a GPU to say (``jaxllm bench latency -pp 2
--pp-micro-batches 1``; ``make_forward(..., micro_batches=M)`` fixes M).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxllm.parallel.mesh import PP_AXIS, pipeline_parallel_size

# Past this many tokens a micro-batch's matmuls are compute-bound on a GPU (a guess from the
# H200's ~300 flop/byte balance, not measured here), so cutting a step finer shrinks the
# bubble without re-reading weights for nothing.
MIN_MICRO_BATCH_TOKENS = 256
# Each micro-batch re-reads its stage's weights; at M = 4 pp the bubble is down to 1/9 (pp = 2).
MAX_MICRO_BATCHES_PER_STAGE = 4
PAD_SLOT = -1  # jaxllm.kv_pool.PAD_SLOT (kv_pool imports this package: no import back)

# (layer params [L/pp, ...], hidden [Tm, H], pool [L/pp, ...], cos, sin [Tm, D], batch)
#   -> (hidden [Tm, H], pool): one stage's layers over one micro-batch.
StageFn = Callable[[Any, jax.Array, Any, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def num_micro_batches(num_tokens: int, pp: int) -> int:
    """M for a step of ``num_tokens`` (padded) tokens: pp, or up to 4 pp while each
    micro-batch keeps :data:`MIN_MICRO_BATCH_TOKENS`; fewer than pp only for a step of fewer
    than pp tokens (one token a micro-batch)."""
    if num_tokens < pp:
        return num_tokens
    per_stage = num_tokens // (pp * MIN_MICRO_BATCH_TOKENS)
    return pp * max(1, min(MAX_MICRO_BATCHES_PER_STAGE, per_stage))


def bubble_fraction(num_micro: int, pp: int) -> float:
    """The share of a stage's iterations spent idle: (pp - 1) / (M + pp - 1)."""
    return (pp - 1) / (num_micro + pp - 1)


def _is_decode(batch) -> bool:
    """Only a batch that says so (the engine's and ``generate()``'s decode steps): a batch
    whose T == S by chance may hold several tokens of one sequence, which cutting the
    sequence axis with the token axis would part from their sequence."""
    return getattr(batch, "decode_only", None) is True


def _pad_rows(x: jax.Array, rows: int, value) -> jax.Array:
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1),
                   constant_values=value)


def pad_batch(batch, num_tokens: int):
    """``batch`` with its token axis (and for a decode batch its sequence axis) padded to
    ``num_tokens``: padded tokens write nothing and belong to no sequence."""
    total = batch.query_start_loc[-1]
    padded = batch.replace(positions=_pad_rows(batch.positions, num_tokens, 0),
                           slot_mapping=_pad_rows(batch.slot_mapping, num_tokens, PAD_SLOT),
                           input_ids=_pad_rows(batch.input_ids, num_tokens, 0))
    if _is_decode(batch):
        padded = padded.replace(
            block_tables=_pad_rows(batch.block_tables, num_tokens, 0),
            seq_lens=_pad_rows(batch.seq_lens, num_tokens, 0),
            query_start_loc=_pad_rows(batch.query_start_loc, num_tokens + 1, total))
    return padded


def micro_batch(batch, index: jax.Array, size: int, live: jax.Array):
    """Micro-batch ``index`` (i32[]): tokens [index size, (index + 1) size) of a padded
    ``batch``, as a batch of its own. Its sequences end at their last token in it (their
    ``seq_lens`` shortened to match), sequences with no token in it look like padding, and
    a decode batch's micro-batch keeps only its own sequences (T = S, the decode kernel's
    shape). Not ``live``: every K/V write is dropped (a bubble iteration)."""
    start = index * size
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, size)  # noqa: E731
    slots = jnp.where(live, take(batch.slot_mapping), PAD_SLOT)
    tables, seq_lens, starts = batch.block_tables, batch.seq_lens, batch.query_start_loc
    if _is_decode(batch):
        tables, seq_lens = take(tables), take(seq_lens)  # [Tm, W], [Tm]
        starts = jax.lax.dynamic_slice_in_dim(starts, start, size + 1)  # [Tm + 1]
    ends = starts[1:]  # [S] each sequence's end in the padded token axis
    local = jnp.clip(starts - start, 0, size)  # [S + 1]
    seq_lens = seq_lens - jnp.maximum(ends - (start + size), 0)
    seq_lens = jnp.where(local[1:] > local[:-1], seq_lens, 0)
    # decode_only stated: a mixed micro-batch may have Tm == S, which would read as a decode.
    return batch.replace(input_ids=take(batch.input_ids), positions=take(batch.positions),
                         slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                         query_start_loc=local, decode_only=_is_decode(batch))


def pipelined_layers(stage_fn: StageFn, layer_params: Any, hidden: jax.Array, kv_pool: Any,
                     cos: jax.Array, sin: jax.Array, batch, mesh: Mesh,
                     num_micro: int | None = None) -> tuple[jax.Array, Any]:
    """The whole layer stack over ``hidden`` [T, H] as ``pp`` stages in a GPipe schedule
    (module docstring) of ``num_micro`` micro-batches (None: :func:`num_micro_batches`);
    returns the last stage's hidden states [T, H] and the pool."""
    pp = pipeline_parallel_size(mesh)
    num_tokens, width = hidden.shape
    num_micro = min(num_micro or num_micro_batches(num_tokens, pp), num_tokens)
    size = -(-num_tokens // num_micro)  # Tm
    padded = num_micro * size
    batch = pad_batch(batch, padded)
    hidden = _pad_rows(hidden, padded, 0).reshape(num_micro, size, width)  # [M, Tm, H]
    cos = _pad_rows(cos, padded, 0).reshape(num_micro, size, -1)  # [M, Tm, D]
    sin = _pad_rows(sin, padded, 0).reshape(num_micro, size, -1)
    forward_perm = [(s, s + 1) for s in range(pp - 1)]

    def stages(layer_params, kv_pool, hidden, cos, sin, batch):
        stage = jax.lax.axis_index(PP_AXIS)
        received = jnp.zeros((size, width), hidden.dtype)  # from the previous stage
        outputs = jnp.zeros((num_micro, size, width), hidden.dtype)  # the last stage's
        for step in range(num_micro + pp - 1):  # unrolled: M + pp - 1 is small
            index = step - stage
            live = (index >= 0) & (index < num_micro)
            index = jnp.clip(index, 0, num_micro - 1)
            x = jnp.where(stage == 0, hidden[index], received)  # [Tm, H]
            x, kv_pool = stage_fn(layer_params, x, kv_pool, cos[index], sin[index],
                                  micro_batch(batch, index, size, live))
            keep = live & (stage == pp - 1)
            outputs = outputs.at[index].set(jnp.where(keep, x, outputs[index]))
            if step < num_micro + pp - 2:
                received = jax.lax.ppermute(x, PP_AXIS, forward_perm)
        return outputs[None], kv_pool  # [1, M, Tm, H]: this stage's

    staged = PartitionSpec(PP_AXIS)
    outputs, kv_pool = jax.shard_map(
        stages, mesh=mesh, axis_names={PP_AXIS},
        in_specs=(staged, staged, PartitionSpec(), PartitionSpec(), PartitionSpec(),
                  PartitionSpec()),
        out_specs=(staged, staged), check_vma=False,
    )(layer_params, kv_pool, hidden, cos, sin, batch)
    return outputs[-1].reshape(padded, width)[:num_tokens], kv_pool  # [T, H]


__all__ = ["MIN_MICRO_BATCH_TOKENS", "bubble_fraction", "micro_batch", "num_micro_batches",
           "pad_batch", "pipelined_layers"]
