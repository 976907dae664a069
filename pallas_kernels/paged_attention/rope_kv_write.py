"""The qkv projection's output into attention's inputs in one kernel (Pallas, Triton backend):
RoPE on the queries and keys, the keys and values written into the pool.

In XLA this is three kernels a layer at a decode step (``benchmarks/step_kernels.py``: a
scatter each for K and V, the queries' rotation), each reading the qkv row. One program takes
one head of one token::

    grid = (T, Hkv, G + 2)                 the fused qkv's column order: per KV head j, its G
                                           query heads, then k_j, then v_j
    program (t, j, h):  y = qkv[t, head (j, h)]        halves y1, y2 [D/2] in float32
                        h < G + 1:  y = round_dtype(y1 cos1 - y2 sin1, y2 cos2 + y1 sin2)
                        h < G:      q[t, j G + h] = y
                        h = G:      k_pool[layer, slot t] [j] = y      (slot < 0: no write)
                        h = G + 1:  v_pool[layer, slot t] [j] = y

The rotation is :func:`rotate_half`, the model's (cos/sin [T, D], both halves' angles
given). The qkv row may come as the 4-bit GEMV's split-K partials f32[S, T, N]: each program
then sums its head's S partials (in split order) and rounds them as the projection would,
instead of XLA summing them in a kernel of its own before this one. :func:`rope_kv_write`
has the signature of :func:`rope_kv_write_reference`; a pool of another dtype than qkv's
(the FP8 KV cache) is not taken (:func:`unsupported`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .common import flat_pool, next_pow2

NUM_WARPS = 1  # a head's row: D / 2 values a half, one warp


def unsupported(qkv_shape: tuple[int, ...], pool_shape: tuple[int, ...], qkv_dtype,
                pool_dtype) -> str | None:
    """Why the kernel cannot take this qkv [T, Hkv (G + 2) D] and pool (None: it can)."""
    *_, kv_heads, head_dim = pool_shape
    if len(qkv_shape) != 2 or qkv_shape[1] % (kv_heads * head_dim):
        return f"qkv {qkv_shape} is not [T, Hkv (G + 2) D] for {kv_heads} KV heads of {head_dim}"
    if head_dim < 4 or next_pow2(head_dim) != head_dim:
        return f"head dim {head_dim} must be a power of two (its halves are one block each)"
    if jnp.dtype(pool_dtype) != jnp.dtype(qkv_dtype):
        return f"a {jnp.dtype(pool_dtype).name} pool is written through XLA (the cast)"
    return None


def _read_half(qkv_ref, t, col, half: int, dtype, splits: int):
    """Token t's values [col, col + half) in float32: of qkv [T, N], or with ``splits`` the
    sum of the projection's split partials f32[splits, T, N] in split order, rounded to
    ``dtype`` as the projection's own output is."""
    if not splits:
        return qkv_ref[t, pl.ds(col, half)].astype(jnp.float32)
    parts = [qkv_ref[s, t, pl.ds(col, half)] for s in range(splits)]  # issued together
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total.astype(dtype).astype(jnp.float32)


def _kernel(layer_ref, slot_ref, qkv_ref, cos_ref, sin_ref, _k_in, _v_in, q_ref, k_ref, v_ref,
            *, group: int, head_dim: int, kv_heads: int, num_blocks: int, block_size: int,
            dtype, splits: int):
    t, j, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    half = head_dim // 2
    col = (j * (group + 2) + h) * head_dim
    lo = _read_half(qkv_ref, t, col, half, dtype, splits)
    hi = _read_half(qkv_ref, t, col + half, half, dtype, splits)

    @pl.when(h <= group)  # a query or the key: rotated
    def _rotated():
        cos_lo, cos_hi = cos_ref[t, pl.ds(0, half)], cos_ref[t, pl.ds(half, half)]
        sin_lo, sin_hi = sin_ref[t, pl.ds(0, half)], sin_ref[t, pl.ds(half, half)]
        out_lo = (lo * cos_lo - hi * sin_lo).astype(dtype)
        out_hi = (hi * cos_hi + lo * sin_hi).astype(dtype)

        @pl.when(h < group)
        def _query():
            row = t * kv_heads * group + j * group + h
            q_ref[row, pl.ds(0, half)] = out_lo
            q_ref[row, pl.ds(half, half)] = out_hi

        @pl.when(h == group)
        def _key():
            _store_slot(k_ref, layer_ref, slot_ref, t, j, out_lo, out_hi, half=half,
                        kv_heads=kv_heads, num_blocks=num_blocks, block_size=block_size)

    @pl.when(h == group + 1)
    def _value():
        _store_slot(v_ref, layer_ref, slot_ref, t, j, lo.astype(dtype), hi.astype(dtype),
                    half=half, kv_heads=kv_heads, num_blocks=num_blocks, block_size=block_size)


def _store_slot(pool_ref, layer_ref, slot_ref, t, j, lo, hi, *, half: int, kv_heads: int,
                num_blocks: int, block_size: int):
    """Head j's halves into the flat pool's row of (layer, token t's slot); none for a padded
    token's slot (< 0)."""
    slot = slot_ref[t]

    @pl.when(slot >= 0)
    def _write():
        row = ((layer_ref[0] * num_blocks + slot // block_size) * block_size
               + slot % block_size) * kv_heads + j
        pool_ref[row, pl.ds(0, half)] = lo
        pool_ref[row, pl.ds(half, half)] = hi


@functools.partial(jax.jit, static_argnames=("interpret", "dtype"))
def rope_kv_write(
    qkv: jax.Array,  # [T, Hkv (G + 2) D] the fused projection's output, or f32[S, T, ..] its
    # split-K partials (with dtype)
    cos: jax.Array,  # f32[T, D]
    sin: jax.Array,  # f32[T, D]
    k_pool: jax.Array,  # [L, num_blocks, block_size, Hkv, D], updated in place
    v_pool: jax.Array,  # [L, num_blocks, block_size, Hkv, D]
    layer: jax.Array | int,  # i32[]
    slot_mapping: jax.Array,  # i32[T]; < 0: a padded token, nothing written
    *,
    interpret: bool = False,
    dtype=None,  # with partials: the projection's output dtype (their sum is rounded to it)
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (q [T, Hq, D], k_pool, v_pool)
    """With split partials each program sums its head's S partials itself (in split order)
    instead of XLA summing them in a kernel of its own before the call (the 4-bit qkv
    GEMV's: one launch fewer a layer)."""
    splits = qkv.shape[0] if qkv.ndim == 3 else 0
    if splits and (dtype is None or qkv.dtype != jnp.float32):
        raise ValueError(f"split partials must be float32 with the output dtype given, got "
                         f"{qkv.dtype} {qkv.shape} and dtype={dtype}")
    dtype = jnp.dtype(dtype or qkv.dtype)
    why = unsupported(qkv.shape[-2:], k_pool.shape, dtype, k_pool.dtype)
    if why is not None:
        raise ValueError(why)
    _, num_blocks, block_size, kv_heads, head_dim = k_pool.shape
    tokens = qkv.shape[-2]
    group = qkv.shape[-1] // (kv_heads * head_dim) - 2
    whole = pl.BlockSpec()
    kernel = functools.partial(_kernel, group=group, head_dim=head_dim, kv_heads=kv_heads,
                               num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                               splits=splits)
    q, k, v = pl.pallas_call(
        kernel,
        grid=(tokens, kv_heads, group + 2),
        in_specs=[whole] * 7,
        out_specs=[whole] * 3,
        out_shape=[jax.ShapeDtypeStruct((tokens * kv_heads * group, head_dim), dtype),
                   jax.ShapeDtypeStruct(flat_pool(k_pool).shape, k_pool.dtype),
                   jax.ShapeDtypeStruct(flat_pool(v_pool).shape, v_pool.dtype)],
        input_output_aliases={5: 1, 6: 2},
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="rope_kv_write",
    )(jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping.astype(jnp.int32), qkv,
      cos.astype(jnp.float32), sin.astype(jnp.float32), flat_pool(k_pool), flat_pool(v_pool))
    return (q.reshape(tokens, kv_heads * group, head_dim), k.reshape(k_pool.shape),
            v.reshape(v_pool.shape))


def rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE (rotate-half) of x [T, H, D] by cos / sin [T, D], computed in float32:
    ``models.rope.apply_rope``'s steps, repeated here because the kernels import nothing of
    the model (tests/test_layering.py)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def rope_kv_write_reference(qkv, cos, sin, k_pool, v_pool, layer, slot_mapping, *,
                            interpret: bool = False, dtype=None):
    """The model's steps in XLA: the qkv row (split partials: summed, in ``dtype``) split into
    heads, RoPE on q and k (:func:`rotate_half`), K and V set at their slots
    (``kv_pool.write_kv``'s: slots < 0 write nothing)."""
    del interpret
    if qkv.ndim == 3:
        qkv = qkv.sum(axis=0).astype(dtype)
    num_blocks, block_size, kv_heads, head_dim = k_pool.shape[1:]
    tokens = qkv.shape[0]
    heads = qkv.reshape(tokens, kv_heads, -1, head_dim)  # [T, Hkv, G + 2, D]
    group = heads.shape[2] - 2
    q = rotate_half(heads[:, :, :group].reshape(tokens, -1, head_dim), cos, sin)
    k = rotate_half(heads[:, :, group], cos, sin)
    blocks = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)
    offsets = slot_mapping % block_size
    write = lambda pool, x: pool.at[layer, blocks, offsets].set(x.astype(pool.dtype),
                                                                mode="drop")
    return q, write(k_pool, k), write(v_pool, heads[:, :, group + 1])
