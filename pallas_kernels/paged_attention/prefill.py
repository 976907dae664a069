"""Paged prefill / mixed attention in Pallas (Triton backend): flash attention over each
sequence's pages for a chunk of query tokens (chunked prefill, prefix-cache hits, decodes).

A program owns up to ``block_q`` consecutive query tokens of ONE sequence and one kv head;
the ``G`` query heads of that kv head ride along as rows, so a tile has ``block_q * G'`` rows
(``G'`` = G rounded up to a power of two; rows of the G' - G missing heads are masked, so q
and the output stay [T * Hq, D] with no padding in XLA)::

    grid = (Q, Hkv)    Q = static bound on the number of query blocks
    q block i:  tokens [t0[i], t1[i]) of sequence seq[i]     (t1 <= t0: nothing to do)
    rows:       (token, query head) pairs, tile row r = token * G' + head,
                q / output row token * Hq + h * G + head (head < G)
    keys:       the union of the rows' ranges, [min kv_lo, max kv_hi), in compute blocks;
                blocks inside every row's range run without masks, the others with masks.

The padding tail of the token axis (past ``query_start_loc[-1]``) is one more "sequence"
whose rows have no keys, so every output row is written (0 for padding).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import common

_INT_MAX = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tunables of the prefill kernel (static)."""

    # NOTE: 128 x 128 tiles, 8 warps, 3 stages: the fastest of 12 configs on the H200 at 2k
    # chunks over 0 / 2k / 8k cached tokens (2026-12-03: +10 / +3 / +4% over 2 stages;
    # benchmarks/RESULTS.md). Shared memory as Triton 3.6 compiles it for sm_90 (2k tokens over
    # 1k, 32 / 8 heads of 128): 161 KiB over bf16 pages, 128 KiB over FP8 (2 or 3 stages alike);
    # 4-byte tiles take for_dtypes' smaller key block.
    block_q_rows: int = 128  # query rows (tokens x query heads of a kv head) per program
    block_kv: int = 128  # keys per compute step (at least one page)
    num_warps: int = 8
    num_stages: int = 3
    # Query blocks launched last-first (a chunk's last blocks see the most keys, causal), as
    # FlashAttention orders causal attention; any order gives the same output. NOTE: off: on
    # the H200 (2026-12-03) it changed nothing beyond noise (2048-token chunk over 0 / 2k / 8k
    # cached tokens: 136 / 214 / 254 TFLOP/s against 141 / 204 / 254 in launch order).
    heavy_first: bool = False

    @classmethod
    def for_dtypes(cls, q_dtype, pool_dtype) -> PrefillConfig:
        """The default for a query and pool dtype. Over float32 pages, 128-key tiles need 256
        KiB of shared memory even with bf16 queries (an H200 SM has 227); 64-key tiles with
        float32 queries 160 KiB (Triton 3.6 for sm_90)."""
        widest = max(jnp.dtype(q_dtype).itemsize, jnp.dtype(pool_dtype).itemsize)
        return cls(block_kv=64) if widest >= 4 else cls()

    def __post_init__(self):
        for name in ("block_q_rows", "block_kv"):
            value = getattr(self, name)
            if value < 16 or value != common.next_pow2(value):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two <= 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


def query_blocks(query_start_loc: jax.Array, num_tokens: int, block_q: int,
                 skip_single_token_seqs: bool = False):
    """(seq, t0, t1) i32[Q] for every query block; the padding tail is pseudo-sequence S.
    With ``skip_single_token_seqs`` the blocks of one-token sequences are empty (t1 = t0)."""
    num_seqs = query_start_loc.shape[0] - 1
    starts = jnp.concatenate([query_start_loc.astype(jnp.int32),
                              jnp.full((1,), num_tokens, jnp.int32)])  # [S + 2]
    counts = pl.cdiv(jnp.maximum(starts[1:] - starts[:-1], 0), block_q)  # [S + 1]
    ends = jnp.cumsum(counts)
    # Each sequence wastes less than one block; each block holds at least one token.
    bound = min(pl.cdiv(num_tokens, block_q) + num_seqs + 1, num_tokens)
    block = jnp.arange(bound, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(ends, block, side="right", method="scan_unrolled"),
                        num_seqs)  # (no while loop: see common.token_kv_ranges)
    t0 = starts[owner] + (block - (ends[owner] - counts[owner])) * block_q
    t1 = jnp.minimum(t0 + block_q, starts[owner + 1])
    if skip_single_token_seqs:
        single = (owner < num_seqs) & (starts[owner + 1] - starts[owner] == 1)
        t1 = jnp.where(single, t0, t1)
    used = block < ends[-1]
    return (jnp.minimum(owner, num_seqs - 1).astype(jnp.int32),
            jnp.where(used, t0, 0).astype(jnp.int32), jnp.where(used, t1, 0).astype(jnp.int32))


def _prefill_kernel(layer_ref, tables_ref, bseq_ref, bt0_ref, bt1_ref, lo_ref, hi_ref, q_ref,
                    k_ref, v_ref, o_ref, *, scale_log2: float, num_pages: int, block_size: int,
                    num_kv_heads: int, group: int, group_pad: int, block_q: int,
                    block_kv: int):
    qblock, head = pl.program_id(0), pl.program_id(1)
    head_dim = q_ref.shape[1]
    rows = block_q * group_pad
    layer_row, seq = layer_ref[0] * num_pages, bseq_ref[qblock]
    t0, t1 = bt0_ref[qblock], bt1_ref[qblock]

    # Row r of the tile is query head r % G' of token t0 + r // G': flat row q_row[r] of q
    # [T * Hq, D] when r % G' < G. The other rows (G' > G) are masked, read as 0, never stored.
    row = jnp.arange(rows, dtype=jnp.int32)
    token = t0 + (row >> (group_pad.bit_length() - 1))  # group_pad is a power of two
    token_ok = token < t1  # [M]
    q_head = row & (group_pad - 1)
    row_ok = token_ok & (q_head < group)
    # Masked rows get distinct rows past q's end: one aliasing a real row (the next token's
    # head 0 when Hkv = 1) would clobber it in the interpreter, whose masked store writes back.
    q_row = jnp.where(row_ok, token * (num_kv_heads * group) + head * group + q_head,
                      q_ref.shape[0] + row)
    lo_r = pltriton.load(lo_ref.at[token], mask=token_ok, other=0)
    hi_r = pltriton.load(hi_ref.at[token], mask=token_ok, other=0)
    lo_min = jnp.where(token_ok, lo_r, _INT_MAX).min()
    lo_max = lo_r.max()
    hi_min = jnp.where(token_ok, hi_r, _INT_MAX).min()
    hi_max = hi_r.max()

    idx = (q_row[:, None], jnp.arange(head_dim, dtype=jnp.int32)[None, :])
    tile_mask = jnp.broadcast_to(row_ok[:, None], (rows, head_dim))
    dtype = common.compute_dtype(q_ref.dtype, k_ref.dtype)
    q, scale_log2 = common.query_for_dots(pltriton.load(q_ref.at[idx], mask=tile_mask, other=0),
                                          k_ref.dtype, scale_log2)

    def step(masked: bool):
        def body(block, carry):
            keys = block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            key_mask = logit_mask = None
            if masked:
                key_mask = (keys >= lo_min) & (keys < hi_max)
                logit_mask = (keys[None, :] >= lo_r[:, None]) & (keys[None, :] < hi_r[:, None])
            k, v = common.load_kv_block(
                k_ref, v_ref, tables_ref, layer_row, seq, head, block, block_size=block_size,
                num_kv_heads=num_kv_heads, block_kv=block_kv, key_mask=key_mask, dtype=dtype)
            return common.softmax_step(q, k, v, carry, scale_log2, logit_mask)
        return body

    first, full_start, full_end, last = common.block_ranges(
        lo_min, hi_max, lo_max, hi_min, block_kv)
    carry = (jnp.zeros((rows, head_dim), jnp.float32),
             jnp.full((rows,), common.MASK_VALUE, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    carry = jax.lax.fori_loop(first, full_start, step(True), carry)
    carry = jax.lax.fori_loop(full_start, full_end, step(False), carry)
    carry = jax.lax.fori_loop(full_end, last, step(True), carry)
    out, _ = common.finish(carry)
    pltriton.store(o_ref.at[idx], out.astype(o_ref.dtype), mask=tile_mask)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "config", "interpret",
                                             "skip_single_token_seqs"))
def paged_attention_prefill(
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
    config: PrefillConfig | None = None,
    interpret: bool = False,
    skip_single_token_seqs: bool = False,
) -> jax.Array:  # [T, Hq, D] in q.dtype
    """Same contract as :func:`paged_attention_reference`; any mix of chunks and decodes.
    ``skip_single_token_seqs`` leaves the rows of one-token sequences unwritten (undefined),
    for a caller that computes them elsewhere (:func:`paged_attention_mixed`)."""
    common.check_shapes(q, k_pool, v_pool)
    config = config or PrefillConfig.for_dtypes(q.dtype, k_pool.dtype)
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    group_pad = common.next_pow2(group)
    block_q = max(1, config.block_q_rows // group_pad)
    block_kv = max(config.block_kv, block_size)  # whole pages

    _, lo, hi = common.token_kv_ranges(seq_lens, query_start_loc, positions, sliding_window)
    bseq, bt0, bt1 = query_blocks(query_start_loc, num_tokens, block_q, skip_single_token_seqs)
    if config.heavy_first:
        bseq, bt0, bt1 = bseq[::-1], bt0[::-1], bt1[::-1]
    whole = pl.BlockSpec()
    kernel = functools.partial(
        _prefill_kernel, scale_log2=scale * common.LOG2E, num_pages=k_pool.shape[1],
        block_size=block_size, num_kv_heads=num_kv_heads, group=group, group_pad=group_pad,
        block_q=block_q, block_kv=block_kv)
    out = pl.pallas_call(
        kernel,
        grid=(bseq.shape[0], num_kv_heads),
        in_specs=[whole] * 10,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((num_tokens * num_q_heads, head_dim), q.dtype),
        compiler_params=common.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="paged_attention_prefill",
    )(jnp.asarray(layer, jnp.int32).reshape(1), block_tables.astype(jnp.int32), bseq, bt0, bt1,
      lo, hi, q.reshape(num_tokens * num_q_heads, head_dim),  # free: no copy, no padding
      common.flat_pool(k_pool), common.flat_pool(v_pool))
    return out.reshape(num_tokens, num_q_heads, head_dim)
