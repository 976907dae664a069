"""SwiGLU and the down projection's per-token FP8 quantization in one kernel (Pallas, Triton
backend): the FP8 MLP's steps between its two GEMMs.

In XLA the step is two passes over gate_up's output: a reduction for each token's absmax of
``silu(gate) up``, then the conversion that recomputes it (RESULTS.md, 2026-12-04: 13% of an
8,192-token FP8 step, the two reading gate_up's float32 product from memory twice). Here one
program takes one token's row in chunks, twice: the second pass finds the row in L2 (a row is
2F x 2-4 bytes, ~57-115 KB for Llama-3-8B), so memory sees one read and one FP8 write.

    grid = (T,)
    program t, pass 1: for each chunk of C (gate, up) pairs of row t:
                   y = round_dtype(product[t] x_scale[t] w_scale)   gate_up's output
                   h = round_dtype(silu(y_gate) y_up)                SwiGLU's, in the model dtype
                   absmax = max(absmax, |h|)
               scale[t] = absmax / 448
               pass 2: each chunk's h again, out[t] = fp8(h / scale[t])

C is the largest power of two dividing F, at most :data:`CHUNK` (no masked tail).
:func:`swiglu_quantize_fp8` has the signature of :func:`~.reference.swiglu_quantize_fp8_reference`.
Not in the engine: ``benchmarks/fp8_mlp.py`` times it beside XLA's two passes first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .reference import FP8_DTYPE, FP8_MAX
from .rows_fp8 import per_token_fp8_call

CHUNK = 2048  # (gate, up) pairs a step: 32 float32 of each array a thread at 4 warps


def unsupported(product_shape: tuple[int, ...]) -> str | None:
    """Why this kernel cannot take a product of this shape (None: it can)."""
    if len(product_shape) != 2 or product_shape[-1] % 2:
        return f"product {product_shape} must be [T, 2F]"
    return None


def _kernel(product_ref, x_scale_ref, w_scale_ref, out_ref, scale_ref, *, f: int,
            chunk: int, dtype):
    x_scale = x_scale_ref[0]

    def swiglu(c):  # SwiGLU's output for pairs [c chunk, (c + 1) chunk): f32 [chunk]
        cols = pl.ds(c * 2 * chunk, 2 * chunk)
        p = pltriton.load(product_ref.at[cols]).astype(jnp.float32)
        # gate_up's output, rounded to the model dtype as the model rounds it
        y = (p * x_scale * pltriton.load(w_scale_ref.at[cols])).astype(dtype)
        # (gate_i, up_i) pairs apart: a sum over each pair's two lanes, one zeroed (no
        # strided load: JAX's interpreter has none)
        pairs = y.astype(jnp.float32).reshape(chunk, 2)
        is_gate = jax.lax.broadcasted_iota(jnp.int32, (chunk, 2), 1) == 0
        g = jnp.sum(jnp.where(is_gate, pairs, 0.0), axis=1)
        u = jnp.sum(jnp.where(is_gate, 0.0, pairs), axis=1)
        return (g * (1.0 / (1.0 + jnp.exp(-g))) * u).astype(dtype).astype(jnp.float32)

    steps = f // chunk
    absmax = jax.lax.fori_loop(
        0, steps, lambda c, m: jnp.maximum(m, jnp.max(jnp.abs(swiglu(c)))), jnp.float32(0))
    scale = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)

    def write(c, carry):
        q = jnp.clip(swiglu(c) / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
        pltriton.store(out_ref.at[pl.ds(c * chunk, chunk)], q)
        return carry

    jax.lax.fori_loop(0, steps, write, 0)
    scale_ref[0] = scale


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def swiglu_quantize_fp8(
    product: jax.Array,  # [T, 2F] the gate_up FP8 GEMM's unscaled product (gate_i, up_i pairs)
    x_scale: jax.Array,  # f32 [T, 1]: gate_up's per-token activation scales
    w_scale: jax.Array,  # f32 [2F]: gate_up's per-channel weight scales
    dtype,  # the model's activation dtype
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (float8_e4m3fn [T, F], f32 [T, 1])
    why = unsupported(product.shape)
    if why is not None:
        raise ValueError(why)
    tokens, two_f = product.shape
    f = two_f // 2
    chunk = min(CHUNK, f & -f)  # the largest power of two dividing F
    kernel = functools.partial(_kernel, f=f, chunk=chunk, dtype=jnp.dtype(dtype))
    return per_token_fp8_call(kernel, tokens=tokens, width=f,
                              in_specs=[pl.BlockSpec((None, two_f), lambda t: (t, 0)),
                                        pl.BlockSpec((None, 1), lambda t: (t, 0)),
                                        pl.BlockSpec((two_f,), lambda t: (0,))],
                              name="swiglu_quantize_fp8", interpret=interpret,
                              )(product, x_scale.astype(jnp.float32), w_scale.astype(jnp.float32))
