"""Pieces shared by the Pallas (Triton) paged-attention kernels: the per-token key ranges, the
paged K/V block load and the online-softmax step.

Both kernels read the engine's pool layout directly (no conversion)::

    k_pool[layer, page, slot, kv_head, :]    [L, NB, BS, Hkv, D]

seen by the kernels as the free 2-D view ``[L * NB * BS * Hkv, D]``. One compute block is
``block_kv`` consecutive keys of a sequence (``block_kv / BS`` block-table entries); its K (or V)
tile for one kv head is a gather of ``block_kv`` rows of ``D`` contiguous elements (256 bytes
for bf16, D = 128), loaded straight into the ``[block_kv, D]`` layout the dots use::

    row(key) = ((layer * NB + block_tables[seq, key // BS]) * BS + key % BS) * Hkv + kv_head

Keys of flat token ``t`` are the half-open range ``[kv_lo[t], kv_hi[t])`` of its sequence:
``kv_hi = min(seq_len, position + 1)`` (causal) and ``kv_lo = position - window + 1`` (sliding
window, else 0). Padding tokens (past ``query_start_loc[-1]``) get an empty range, and the
kernels write 0 for them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

LOG2E = math.log2(math.e)
# Finite "minus infinity" for masked logits: exp2 of (MASK_VALUE - m) underflows to 0 and no
# arithmetic on it gives NaN. A row whose running max is still MASK_VALUE saw no valid key.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def compiler_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
    """Triton params, always explicit: with None, jax 0.11 lowers pallas_call to Mosaic GPU."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_shapes(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array) -> None:
    """Raises ValueError for shapes the kernels cannot run (the dispatch then uses the spec)."""
    _, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kd = k_pool.shape
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"{k_pool.shape=} must equal {v_pool.shape=}")
    if kd != head_dim:
        raise ValueError(f"pool head dim {kd} must equal the query head dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    if head_dim < 16 or head_dim != next_pow2(head_dim):
        raise ValueError(f"{head_dim=} must be a power of two >= 16 (Triton tile shapes)")
    if block_size != next_pow2(block_size):
        raise ValueError(f"{block_size=} must be a power of two (Triton tile shapes)")


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)


# FP8 pages are widened to float16, not to the query's bfloat16: Hopper turns two e4m3 values
# into float16 with one instruction, but reaches bfloat16 only through float16 (one more,
# scalar conversion per element). Counted in the SASS of the decode kernel for sm_90
# (benchmarks/kernel_sass.py): its main loop is 760 instructions a step widening to bfloat16,
# 560 to float16, 325 over bfloat16 pages; on the H200 the bfloat16-widened FP8 decode was
# slower than bf16 pages.
# The query enters float16 scaled by 2^-8 (exact) so that any query below 2^24 stays finite;
# the scores are scaled back in the softmax's constant.
FP8_QUERY_SCALE = 2.0**-8


def compute_dtype(q_dtype, kv_dtype):
    """The dtype of both dots: the pool's, except that FP8 pages (``--kv-cache-dtype fp8``)
    are widened to float16 as they are read (the pool holds half the bytes; float16 holds every
    e4m3 value exactly and the activations' bfloat16 precision)."""
    return jnp.float16 if is_fp8(kv_dtype) else kv_dtype


def query_for_dots(q: jax.Array, kv_dtype, scale_log2: float) -> tuple[jax.Array, float]:
    """``q`` in :func:`compute_dtype`, and the softmax's scale for it (FP8 pages: q scaled
    into float16's range, the scale compensating)."""
    if not is_fp8(kv_dtype):
        return q.astype(compute_dtype(q.dtype, kv_dtype)), scale_log2
    return ((q.astype(jnp.float32) * FP8_QUERY_SCALE).astype(jnp.float16),
            scale_log2 / FP8_QUERY_SCALE)


def kernels_support(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array) -> bool:
    try:
        check_shapes(q, k_pool, v_pool)
    except ValueError:
        return False
    return True


def token_kv_ranges(
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    positions: jax.Array,  # i32[T]
    sliding_window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(seq i32[T], kv_lo i32[T], kv_hi i32[T]) for every flat token, as the reference defines."""
    num_tokens = positions.shape[0]
    num_seqs = seq_lens.shape[0]
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    # unrolled: the default "scan" is an HLO while loop, which XLA's GPU runtime launches
    # from the host outside the step's command buffer (CUDA graph), kernel by kernel
    seq = jnp.searchsorted(query_start_loc[1:], tokens, side="right", method="scan_unrolled")
    seq = jnp.minimum(seq, num_seqs - 1).astype(jnp.int32)
    real = tokens < query_start_loc[-1]
    hi = jnp.where(real, jnp.minimum(seq_lens[seq], positions + 1), 0)
    lo = jnp.zeros_like(hi) if sliding_window is None else positions - sliding_window + 1
    lo = jnp.clip(lo, 0, hi)
    return seq, lo.astype(jnp.int32), hi.astype(jnp.int32)


def flat_pool(pool: jax.Array) -> jax.Array:
    """[L, NB, BS, Hkv, D] -> [L * NB * BS * Hkv, D]: a free (bitcast) view with one row per
    (layer, page, slot, kv head), so that a K/V tile is a plain 2-D row gather."""
    num_rows = math.prod(pool.shape[:-1])
    if num_rows >= 2**31:
        raise ValueError(f"the pool has {num_rows} rows; row indices must fit in int32")
    return pool.reshape(num_rows, pool.shape[-1])


def load_kv_block(k_ref, v_ref, tables_ref, layer_row, seq, head, block, *, block_size: int,
                  num_kv_heads: int, block_kv: int, key_mask: jax.Array | None, dtype,
                  widen_v_before_staging: bool = False):
    """K and V of compute block ``block`` (keys ``block * block_kv + [0, block_kv)``) of
    sequence ``seq``, kv head ``head``: two [block_kv, D] tiles from the flat pools.

    ``layer_row`` = layer * NB (first page row of the layer). ``key_mask`` (bool[block_kv])
    marks the keys to read; the others read as 0, so a NaN or garbage page tail never enters
    either product. None: every key is valid. The tiles come back in ``dtype``
    (:func:`compute_dtype`).

    ``widen_v_before_staging`` (FP8 pages, mma.sync kernels: the decode kernel): an FP8 V
    tile is widened where it is loaded, before Triton stages it in shared memory for the P.V
    dot. Left to itself Triton stages the 8-bit tile and widens it after, but that dot reads V
    transposed and there is no 8-bit transposing ldmatrix: the decode kernel's SASS for sm_90
    read it byte by byte (64 LDS.U8 a step per thread). A product with a runtime 1.0 pins the
    conversion before the staging (16-bit ldmatrix.trans; main loop 560 -> 520 instructions,
    counted by benchmarks/kernel_sass.py, not timed). The prefill kernel's wgmma already
    stages widened tiles: there the product only adds work (666 -> 698).
    """
    head_dim = k_ref.shape[1]
    width = tables_ref.shape[1]
    key = jnp.arange(block_kv, dtype=jnp.int32)
    shift = block_size.bit_length() - 1  # block_size is a power of two
    page_col = block * (block_kv // block_size) + (key >> shift)  # [block_kv]
    # Masked even in full blocks: a compute block may be wider than the whole table.
    pages = pltriton.load(tables_ref.at[seq, page_col], mask=page_col < width, other=0)
    rows = ((layer_row + pages) * block_size + (key & (block_size - 1))) * num_kv_heads + head
    idx = (rows[:, None], jnp.arange(head_dim, dtype=jnp.int32)[None, :])
    if key_mask is None:
        if widen_v_before_staging and is_fp8(v_ref.dtype):
            pin = (layer_row >= 0).astype(dtype)  # 1.0, unknown to the compiler
            return k_ref[idx].astype(dtype), v_ref[idx].astype(dtype) * pin
        return k_ref[idx].astype(dtype), v_ref[idx].astype(dtype)
    mask = jnp.broadcast_to(key_mask[:, None], (block_kv, head_dim))

    def masked_load(ref):
        if is_fp8(ref.dtype):  # Triton has no integer-to-FP8 cast for the fill value
            return jnp.where(mask, pltriton.load(ref.at[idx], mask=mask).astype(dtype), 0)
        return pltriton.load(ref.at[idx], mask=mask, other=0).astype(dtype)

    return masked_load(k_ref), masked_load(v_ref)


def softmax_step(q, k, v, carry, scale_log2: float, logit_mask: jax.Array | None):
    """One online-softmax step (base 2) of q [M, D] over keys k, v [N, D].

    carry = (acc f32[M, D], m f32[M], l f32[M]); logit_mask bool[M, N] or None.
    """
    acc, m_prev, l_prev = carry
    precision = jax.lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale_log2  # [M, N]
    if logit_mask is not None:
        s = jnp.where(logit_mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = alpha * l_prev + p.sum(axis=-1)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_next, l_next


def block_ranges(lo, hi, full_lo, full_hi, block_kv: int):
    """Compute-block bounds for keys [lo, hi): (first, full_start, full_end, last).

    Blocks [full_start, full_end) lie inside [full_lo, full_hi) (every key valid for every row,
    no masks); the blocks before and after them need masks. Empty ranges give first == last.
    """
    first = lo // block_kv
    last = jnp.where(hi > lo, pl.cdiv(hi, block_kv), first)
    full_start = jnp.clip(pl.cdiv(full_lo, block_kv), first, last)
    full_end = jnp.clip(full_hi // block_kv, full_start, last)
    return first, full_start, full_end, last


def finish(carry):
    """(out f32[M, D], lse f32[M]) from the online-softmax carry; rows with no key give 0, -inf."""
    acc, m, l_sum = carry
    seen = m > 0.5 * MASK_VALUE
    out = jnp.where(seen[:, None], acc / jnp.where(seen, l_sum, 1.0)[:, None], 0.0)
    lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l_sum, 1.0)), -jnp.inf)
    return out, lse
