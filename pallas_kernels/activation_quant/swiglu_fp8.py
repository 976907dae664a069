"""SwiGLU and the down projection's per-token FP8 quantization in one kernel (Pallas, Triton
backend): the FP8 MLP's steps between its two GEMMs.

In XLA the step is two passes over gate_up's product: a reduction for each token's absmax of
``silu(gate) up``, then the conversion that recomputes it from the product read again. Here one
program holds one token's SwiGLU row in registers: it reads the row's product once, in chunks
all issued before the first is needed, and writes the FP8 row and its scale::

    grid = (T,)
    program t:  for each chunk c of C (gate, up) pairs of row t (unrolled):
                    y = round_dtype(product[t, c] x_scale[t] w_scale[c])   gate_up's output
                    gate, up = the pairs of y apart (Triton's split: no data moves)
                    h[c] = round_dtype(silu(gate) up)                     SwiGLU's, [C] f32
                scale[t] = max |h| / 448;  out[t, c] = fp8(h[c] / scale[t]) for each chunk

The kernel it replaces (RESULTS.md, 2026-12-05, m8) took each row in 2,048-pair chunks twice
in a loop (absmax, then the quantization recomputing SwiGLU), one chunk's loads in flight at a
time, and parted the pairs with a masked sum, a shuffle of every chunk across threads; it lost
to XLA's passes at 256-8,192 tokens. C is the largest power of two dividing F, at most
:data:`CHUNK`; a row of more than :data:`MAX_CHUNKS` chunks or :data:`MAX_F` pairs does not fit
the registers (:func:`unsupported`: the model keeps XLA's passes).
:func:`swiglu_quantize_fp8` has the signature of :func:`~.reference.swiglu_quantize_fp8_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .reference import FP8_DTYPE, FP8_MAX
from .rows_fp8 import per_token_fp8_call

CHUNK = 2048  # (gate, up) pairs a load
MAX_CHUNKS = 16  # chunks unrolled in a program
HELD_A_THREAD = 32  # SwiGLU values (float32 registers) a thread holds while warps are added
MAX_F = 2 * HELD_A_THREAD * 32 * 16  # twice that a thread at 16 warps (Llama-3-70B: 28,672)


def _chunk(f: int) -> int:
    return min(CHUNK, f & -f)  # the largest power of two dividing F, at most CHUNK


def num_warps(f: int) -> int:
    """Warps a program: enough that each thread holds at most HELD_A_THREAD of the row's F
    SwiGLU values, from 4 to 16."""
    warps = 4
    while warps < 16 and f > HELD_A_THREAD * 32 * warps:
        warps *= 2
    return warps


def unsupported(product_shape: tuple[int, ...]) -> str | None:
    """Why this kernel cannot take a product of this shape (None: it can)."""
    if len(product_shape) != 2 or product_shape[-1] % 2:
        return f"product {product_shape} must be [T, 2F]"
    f = product_shape[-1] // 2
    if f > MAX_F or f // _chunk(f) > MAX_CHUNKS:
        return (f"a row of F={f} SwiGLU values is not held in registers (at most {MAX_F}, in at "
                f"most {MAX_CHUNKS} chunks of a power of two dividing F, up to {CHUNK})")
    return None


def _kernel(product_ref, x_scale_ref, w_scale_ref, out_ref, scale_ref, *, f: int,
            chunk: int, dtype):
    x_scale = x_scale_ref[0]
    rows = []  # SwiGLU's row, chunk by chunk: f32 [chunk] each, rounded to dtype
    for c in range(f // chunk):
        cols = pl.ds(c * 2 * chunk, 2 * chunk)
        p = product_ref[cols].astype(jnp.float32)
        # gate_up's output, rounded to the model dtype as the model rounds it
        y = (p * x_scale * w_scale_ref[cols]).astype(dtype).astype(jnp.float32)
        gate, up = jnp.unstack(y.reshape(chunk, 2), axis=-1)
        rows.append((gate * (1.0 / (1.0 + jnp.exp(-gate))) * up).astype(dtype)
                    .astype(jnp.float32))
    absmax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(h)) for h in rows])
    scale = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
    for c, h in enumerate(rows):
        out_ref[pl.ds(c * chunk, chunk)] = jnp.clip(h / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
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
    kernel = functools.partial(_kernel, f=f, chunk=_chunk(f), dtype=jnp.dtype(dtype))
    return per_token_fp8_call(kernel, tokens=tokens, width=f,
                              in_specs=[pl.BlockSpec((None, two_f), lambda t: (t, 0)),
                                        pl.BlockSpec((None, 1), lambda t: (t, 0)),
                                        pl.BlockSpec((two_f,), lambda t: (0,))],
                              name="swiglu_quantize_fp8", num_warps=num_warps(f),
                              interpret=interpret,
                              )(product, x_scale.astype(jnp.float32), w_scale.astype(jnp.float32))
