"""The XLA reference for the 4-bit matmul: dequantize the whole weight, then one dot. It is the
specification the kernel is tested against and the path ``jaxllm.layers.linear`` keeps off
the GPU (so CPU results stay bit-for-bit what they were before the kernel existed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

PER_WORD = 8  # 4-bit values per int32 word


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def unpack_int4(qweight: jax.Array) -> jax.Array:
    """The 4-bit values q i32[.., K, N] (0-15) of words packed along K: qweight i32[.., K/8,
    N], row 8r+j in bits 4j..4j+3 of word row r."""
    *lead, words, n = qweight.shape
    shifts = 4 * jnp.arange(PER_WORD, dtype=jnp.int32)[:, None]  # [8, 1]
    # Arithmetic shift of a negative word drags sign bits in; the mask drops them.
    q = jnp.right_shift(qweight[..., :, None, :], shifts) & 0xF  # [.., K/8, 8, N]
    return q.reshape(*lead, words * PER_WORD, n)


def dequantize_int4(qweight: jax.Array, scales: jax.Array, zeros: jax.Array,
                    dtype=jnp.float32) -> jax.Array:
    """W[k, n] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n], q as :func:`unpack_int4`."""
    return dequantize_nibbles(unpack_int4(qweight), scales, zeros, dtype)


def dequantize_nibbles(q: jax.Array, scales: jax.Array, zeros: jax.Array,
                       dtype=jnp.float32) -> jax.Array:
    """W[k, n] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n] for the 4-bit values
    q i32[.., K, N] (0-15) however they were stored."""
    *lead, k, n = q.shape
    groups = scales.shape[-2]
    q = q.reshape(*lead, groups, k // groups, n)  # [.., G, g, N]
    w = (q - zeros[..., :, None, :].astype(jnp.int32)).astype(dtype) * \
        scales[..., :, None, :].astype(dtype)
    return w.reshape(*lead, k, n)


def int4_matmul_reference(
    x: jax.Array,  # [.., K]
    qweight: jax.Array,  # i32[K/8, N]
    scales: jax.Array,  # [G, N]
    zeros: jax.Array,  # u8[G, N]
    *,
    group_size: int,
    interpret: bool = False,
    config=None,
) -> jax.Array:  # [.., N] in x's dtype
    """``x @ W``: the weight dequantized in x's dtype, then XLA's dot. ``interpret`` and
    ``config`` are the kernel's and are ignored."""
    del interpret, config
    k = qweight.shape[-2] * PER_WORD
    if k % group_size or scales.shape[-2] != k // group_size:
        raise ValueError(f"group_size={group_size} does not give scales' {scales.shape[-2]} "
                         f"groups of K={k}")
    return jnp.dot(x, dequantize_int4(qweight, scales, zeros, x.dtype))
