"""The 4-bit matmul for many tokens through XLA's own int4 GEMM: the weight as XLA's ``int4``
type, its group scales multiplied inside XLA's Triton GEMM (the sub-channel dequantization
fusion), never a bf16 copy of the weight.

Why: above the kernels' token counts the engine's path is the reference (dequantize the whole
weight, then cuBLAS), which writes and reads a bf16 copy of each weight every step; the AWQ
engine's 65-512-row steps took 1.6-2.1x bf16's on the H200 (RESULTS.md, 2026-12-05). XLA fuses
``int4 -> bf16 x scale[group]`` into its GEMM's prologue when told to
(:data:`COMPILE_OPTIONS`; without the option, or with the zero point inside the product, it
materializes the bf16 weight), as compiled for the H200 on the CPU machine. So the zero points
leave the product, with the nibbles centred on 8 (``|q - 8| <= 8`` rounds no coarser than
``q - z``)::

    (q - z) s = (q - 8) s - (z - 8) s
    y[m, n]   = x @ ((q - 8) s)  -  sum_g (sum_{k in g} x[m, k]) (z - 8)[g, n] s[g, n]

the second term a dot of K = K / group_size (the groups' sums of x) in float32.

Per call: the nibbles unpacked into ``int4`` [K, N] (XLA lays them out K-major: read and write
K N / 2 bytes, twice), the GEMM reading them once, and four small ops (x's group sums, the
zero terms, their dot, the subtraction), against the reference's 2 K N bytes written and read.
Same signature as :func:`~.reference.int4_matmul_reference`; results within bf16 rounding of
it, not equal (the product is rounded in another order).

NOTE: not in the engine. Timed on the H200 (``int4_matmul --xla-int4``, RESULTS.md,
2026-12-05) it beat the reference only for gate_up at 128 tokens (192 against 213 us) and lost
everywhere else (down at 128 tokens 162 against 71 us; gate_up at 512 435 against 298): the
six extra launches and the float32 [tokens, N] output and correction cost more than the bf16
copy they save. Kept, with its test, for the benchmark's comparison as XLA's fusion evolves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import PER_WORD, unpack_int4

# What lets XLA's GPU compiler fuse the group scales into the GEMM (an experimental option of
# XLA; jax 0.11.2). Other backends ignore it.
COMPILE_OPTIONS = {"xla_gpu_experimental_enable_subchannel_dequantisation_fusion": True}
CENTRE = 8  # the unsigned nibbles' midpoint: q - 8 fits int4 [-8, 7]


def centred_nibbles(qweight: jax.Array) -> jax.Array:
    """Packed words i32[K/8, N] (row 8r + j in bits 4j..4j+3) as int4 [K, N]: q - 8."""
    return (unpack_int4(qweight) - CENTRE).astype(jnp.int4)


def int4_matmul_xla_int4(
    x: jax.Array,  # [.., K]
    qweight: jax.Array,  # i32[K/8, N]
    scales: jax.Array,  # [G, N]
    zeros: jax.Array,  # u8[G, N]
    *,
    group_size: int,
    interpret: bool = False,
    config=None,
) -> jax.Array:  # [.., N] in x's dtype
    """``x @ W`` with W[k, n] = (q[k, n] - zeros[k // g, n]) scales[k // g, n], as the module
    says. ``interpret`` and ``config`` are the kernels' and are ignored."""
    del interpret, config
    k, n = qweight.shape[-2] * PER_WORD, qweight.shape[-1]
    groups = scales.shape[-2]
    if qweight.ndim != 2 or k % group_size or groups != k // group_size:
        raise ValueError(f"group_size={group_size} does not give scales' {groups} groups of "
                         f"K={k} (a 2-D weight)")
    w = centred_nibbles(qweight).reshape(groups, group_size, n)
    weight = (w.astype(x.dtype) * scales[:, None, :].astype(x.dtype)).reshape(k, n)
    y = jnp.dot(x, weight, preferred_element_type=jnp.float32)  # [.., N]
    zero_terms = (zeros.astype(jnp.float32) - CENTRE) * scales.astype(jnp.float32)  # [G, N]
    x_sums = x.reshape(*x.shape[:-1], groups, group_size).sum(-1, dtype=jnp.float32)
    return (y - jnp.dot(x_sums, zero_terms)).astype(x.dtype)
