"""Paged decode attention in Pallas (Triton backend): one program per (query token, kv head,
split), flash-decoding style.

Each program holds the ``G`` query heads that share kv head ``h`` in a tile of ``G'`` rows (a
power of two >= 16, the smallest tile ``dot`` takes), walks its share of the token's keys in
compute blocks of ``block_kv`` keys, and stores the tile's G real rows. q is read in place
(rows past G are masked loads that read 0) and, with one split, the kernel writes the final
output in q's dtype; with more, float32 partials plus log-sum-exps that one XLA reduction
merges::

    grid = (Hkv, T, K)                                q viewed as [T * Hq, D] (free reshape)
    program (h, t, s):  rows t*Hq + h*G + [0, G)  x  keys [kv_lo[t], kv_hi[t]) of seq(t), s-th
    K = 1:  -> out [T * Hq, D] in q.dtype             (the caller reshapes it to [T, Hq, D])
    K > 1:  -> o f32[T * K * Hq, D], lse f32[T * K * Hq]  (row (t*K + s)*Hq + h*G + g)

NOTE: padding q to G' rows in XLA and slicing / converting the float32 output after the call
cost one pad and 3-4 small fusions a layer (the pad was 0.69 ms of a 34.5 ms 1024-row H200
decode step). Pre-optimization StableHLO of one call, Llama-3-8B heads (32/8, D = 128),
lowered for the H200 on CPU: T = 256 (K = 1) 73 -> 67 ops, pad 1 -> 0, slice 3 -> 2, convert
6 -> 4 (all that is left is token_kv_ranges' metadata on i32[T]); T = 1 (K = 16) 107 -> 103 ops,
pad 1 -> 0, slice 4 -> 2, the combine's 3 reductions kept.

The kernel is correct for any batch (a prompt chunk just re-reads its context once per query
token); it is fast when each sequence has one query token, i.e. decode steps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import common


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tunables of the decode kernel (static)."""

    # NOTE: block_kv=64, num_stages=3 measured best on the H200 (benchmarks/RESULTS.md, sweep
    # at batch 64: 3.45 / 3.76 TB/s at contexts 2048 / 8192 against 3.14 / 3.58 for 128 / 2).
    block_kv: int = 64  # keys per compute step (at least one page)
    num_splits: int | None = None  # split-K partitions per (token, kv head); None: auto
    target_programs: int = 1024  # auto: split until T * Hkv * splits reaches this
    max_splits: int = 16
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if self.block_kv < 16 or self.block_kv != common.next_pow2(self.block_kv):
            raise ValueError(f"block_kv={self.block_kv} must be a power of two >= 16")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits} must be >= 1 or None")
        if self.max_splits < 1:
            raise ValueError(f"max_splits={self.max_splits} must be >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two <= 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")

    def splits(self, num_tokens: int, num_kv_heads: int, num_blocks: int) -> int:
        """Split-K count: fixed, or doubled until the grid has ``target_programs`` programs."""
        if self.num_splits is not None:
            return max(1, min(self.num_splits, num_blocks))
        splits = 1
        while (splits * 2 <= min(self.max_splits, num_blocks)
               and num_tokens * num_kv_heads * splits < self.target_programs):
            splits *= 2
        return splits


def _decode_kernel(layer_ref, tables_ref, seq_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref,
                   o_ref, lse_ref=None, *, scale_log2: float, num_pages: int, block_size: int,
                   num_kv_heads: int, group: int, group_pad: int, block_kv: int,
                   num_splits: int):
    head, token, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer_row, seq = layer_ref[0] * num_pages, seq_ref[token]
    lo, hi = lo_ref[token], hi_ref[token]
    # This split's share of the token's compute blocks (balanced on the real length).
    first_block = lo // block_kv
    num_blocks = jnp.where(hi > lo, pl.cdiv(hi, block_kv) - first_block, 0)
    per_split = pl.cdiv(num_blocks, num_splits)
    split_lo = jnp.maximum(lo, (first_block + split * per_split) * block_kv)
    split_hi = jnp.minimum(hi, (first_block + (split + 1) * per_split) * block_kv)

    # The G query heads of kv head h are G consecutive rows of q [T * Hq, D]; the tile has G'
    # rows, the ones past G masked (read as 0, never stored), so q needs no padding in XLA.
    head_dim = q_ref.shape[1]
    num_q_heads = num_kv_heads * group
    real = jnp.arange(group_pad, dtype=jnp.int32) < group  # [G']
    rows_mask = jnp.broadcast_to(real[:, None], (group_pad, head_dim))
    q_rows = pl.ds(token * num_q_heads + head * group, group_pad)
    dtype = common.compute_dtype(q_ref.dtype, k_ref.dtype)
    q, scale_log2 = common.query_for_dots(  # [G', D]
        pltriton.load(q_ref.at[q_rows, :], mask=rows_mask, other=0), k_ref.dtype, scale_log2)

    def step(masked: bool):
        def body(block, carry):
            keys = block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            key_mask = ((keys >= split_lo) & (keys < split_hi)) if masked else None
            k, v = common.load_kv_block(
                k_ref, v_ref, tables_ref, layer_row, seq, head, block, block_size=block_size,
                num_kv_heads=num_kv_heads, block_kv=block_kv, key_mask=key_mask, dtype=dtype,
                widen_v_before_staging=True)
            logit_mask = None if key_mask is None else jnp.broadcast_to(
                key_mask[None, :], (group_pad, block_kv))
            return common.softmax_step(q, k, v, carry, scale_log2, logit_mask)
        return body

    first, full_start, full_end, last = common.block_ranges(
        split_lo, split_hi, split_lo, split_hi, block_kv)
    carry = (jnp.zeros((group_pad, head_dim), jnp.float32),
             jnp.full((group_pad,), common.MASK_VALUE, jnp.float32),
             jnp.zeros((group_pad,), jnp.float32))
    carry = jax.lax.fori_loop(first, full_start, step(True), carry)
    carry = jax.lax.fori_loop(full_start, full_end, step(False), carry)
    carry = jax.lax.fori_loop(full_end, last, step(True), carry)
    out, lse = common.finish(carry)
    if lse_ref is None:  # one split: the final output, in q's dtype, rows of [T * Hq, D]
        pltriton.store(o_ref.at[q_rows, :], out.astype(o_ref.dtype), mask=rows_mask)
        return
    # A partial: rows of [T * K * Hq, D] (token, split, query head).
    rows = pl.ds((token * num_splits + split) * num_q_heads + head * group, group_pad)
    pltriton.store(o_ref.at[rows, :], out, mask=rows_mask)
    pltriton.store(lse_ref.at[rows], lse, mask=real)


def combine_splits(o: jax.Array, lse: jax.Array, dtype) -> jax.Array:
    """Merges split-K partials o f32[T, K, Hq, D] with log2-sum-exp lse f32[T, K, Hq] into
    [T, Hq, D] in ``dtype``.

    One variadic reduction over K carries each (max lse, weight, weighted sum) and merges two
    as online softmax does, so XLA makes it one kernel (at most two with the division) where
    the max, the weights and the weighted sum as separate reductions were three a call: 32-64
    fewer launches in a Llama-3-8B step on the H200 (``benchmarks/step_kernels.py``)."""
    def merge(a, b):
        (max_a, weight_a, sum_a), (max_b, weight_b, sum_b) = a, b
        top = jnp.maximum(max_a, max_b)
        finite_top = jnp.where(jnp.isfinite(top), top, 0.0)  # two empty splits: weights stay 0
        rescale_a, rescale_b = jnp.exp2(max_a - finite_top), jnp.exp2(max_b - finite_top)
        return (top, weight_a * rescale_a + weight_b * rescale_b,
                sum_a * rescale_a + sum_b * rescale_b)

    split_lse = jnp.broadcast_to(lse[..., None], o.shape)  # the reduction's operands match
    empty = (jnp.float32(-jnp.inf), jnp.float32(0), jnp.float32(0))
    _, total, out = jax.lax.reduce((split_lse, jnp.ones_like(o), o), empty, merge, (1,))
    return (out / jnp.where(total > 0, total, 1.0)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "config", "interpret",
                                             "merge"))
def paged_attention_decode(
    q: jax.Array,  # [T, Hq, D]
    k_pool: jax.Array,  # [L, num_blocks, block_size, Hkv, D]
    v_pool: jax.Array,  # [L, num_blocks, block_size, Hkv, D]
    layer: jax.Array | int,  # i32[]
    block_tables: jax.Array,  # i32[S, W]
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    positions: jax.Array,  # i32[T]
    *,
    scale: float,
    sliding_window: int | None = None,
    config: DecodeConfig | None = None,
    interpret: bool = False,
    merge: bool = True,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [T, Hq, D] in q.dtype
    """Same contract as :func:`paged_attention_reference`; built for one query token a sequence.
    ``merge=False``: where the kernel splits the keys, its partials as they are, ``(o
    f32[T, K, Hq, D], lse f32[T, K, Hq])``, for a consumer that merges them itself
    (:func:`combine_splits`' contract)."""
    common.check_shapes(q, k_pool, v_pool)
    config = config or DecodeConfig()
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    group_pad = max(16, common.next_pow2(group))
    num_pages = k_pool.shape[1]
    block_kv = max(config.block_kv, block_size)  # whole pages
    num_splits = config.splits(num_tokens, num_kv_heads,
                               pl.cdiv(block_tables.shape[1] * block_size, block_kv))

    seq, lo, hi = common.token_kv_ranges(seq_lens, query_start_loc, positions, sliding_window)
    whole = pl.BlockSpec()
    kernel = functools.partial(
        _decode_kernel, scale_log2=scale * common.LOG2E, num_pages=num_pages,
        block_size=block_size, num_kv_heads=num_kv_heads, group=group, group_pad=group_pad,
        block_kv=block_kv, num_splits=num_splits)
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((num_tokens * num_q_heads, head_dim), q.dtype)]
    else:
        rows = num_tokens * num_splits * num_q_heads
        out_shape = [jax.ShapeDtypeStruct((rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((rows,), jnp.float32)]
    outs = pl.pallas_call(
        kernel,
        # Heads vary fastest: the programs of one token read neighbouring rows of its pages.
        grid=(num_kv_heads, num_tokens, num_splits),
        in_specs=[whole] * 8,
        out_specs=[whole] * len(out_shape),
        out_shape=out_shape,
        compiler_params=common.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="paged_attention_decode",
    )(jnp.asarray(layer, jnp.int32).reshape(1), block_tables.astype(jnp.int32), seq, lo, hi,
      q.reshape(num_tokens * num_q_heads, head_dim),  # free: no copy, no padding
      common.flat_pool(k_pool), common.flat_pool(v_pool))
    if num_splits == 1:
        return outs[0].reshape(num_tokens, num_q_heads, head_dim)
    o = outs[0].reshape(num_tokens, num_splits, num_q_heads, head_dim)
    lse = outs[1].reshape(num_tokens, num_splits, num_q_heads)
    return combine_splits(o, lse, q.dtype) if merge else (o, lse)
