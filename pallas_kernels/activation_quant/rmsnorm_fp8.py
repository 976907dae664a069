"""A decoder layer's RMSNorm and the next FP8 projection's per-token quantization in one kernel
(Pallas, Triton backend).

In XLA the pair is three kernels a norm: the sum of squares, the absmax of the normalized row,
and the conversion that recomputes it (``benchmarks/step_kernels.py``: 3 of the 6 kernels a
layer FP8 adds to a Llama-3-8B decode step, which launches 839 against bf16's 647 at one row).
One program takes one token's row whole (H values in registers: 32 a thread at 4 warps and
H = 4096) and writes its FP8 row and scale::

    grid = (T,)
    program t:  x = row t in float32
                h = round_dtype(round_dtype(x rsqrt(mean(x^2) + eps)) weight)   RMSNorm's
                scale[t] = max(|h|) / 448;  out[t] = fp8(h / scale[t])

:func:`rmsnorm_quantize_fp8` has the signature of
:func:`~.reference.rmsnorm_quantize_fp8_reference`. Not in the engine by default: the model
runs it when ``JAXLLM_FP8_NORM_KERNEL=on`` (``jaxllm.layers.fp8_kernels``), until timed on a
GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .reference import FP8_DTYPE, FP8_MAX

NUM_WARPS = 4
MAX_HIDDEN = 16384  # a row in registers: 128 float32 a thread at 4 warps


def unsupported(x_shape: tuple[int, ...]) -> str | None:
    """Why this kernel cannot take a residual stream of this shape (None: it can)."""
    if len(x_shape) != 2:
        return f"x {x_shape} must be [T, H]"
    hidden = x_shape[1]
    if hidden & (hidden - 1) or not 16 <= hidden <= MAX_HIDDEN:
        return f"hidden size {hidden} must be a power of two in [16, {MAX_HIDDEN}] (one block)"
    return None


def store_quantized_row(h, out_ref, scale_ref):
    """A float32 row ``h`` [H] stored in FP8 with its scale (absmax / 448, 1 for an all-zero
    row), as the reference's ``quantize_rows_fp8``."""
    absmax = jnp.max(jnp.abs(h))
    scale = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
    out_ref[...] = jnp.clip(h / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    scale_ref[0] = scale


def _kernel(x_ref, weight_ref, out_ref, scale_ref, *, eps: float, dtype):
    x = x_ref[...].astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x) + eps)
    store_quantized_row((weight_ref[...] * normed.astype(dtype)).astype(jnp.float32), out_ref,
                        scale_ref)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rmsnorm_quantize_fp8(
    x: jax.Array,  # [T, H] the residual stream
    weight: jax.Array,  # [H] the norm's scale, in the model dtype
    eps: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (float8_e4m3fn [T, H], f32 [T, 1])
    why = unsupported(x.shape)
    if why is not None:
        raise ValueError(why)
    tokens, hidden = x.shape
    kernel = functools.partial(_kernel, eps=eps, dtype=x.dtype)
    return pl.pallas_call(
        kernel,
        grid=(tokens,),
        in_specs=[pl.BlockSpec((None, hidden), lambda t: (t, 0)),
                  pl.BlockSpec((hidden,), lambda t: (0,))],
        out_specs=[pl.BlockSpec((None, hidden), lambda t: (t, 0)),
                   pl.BlockSpec((None, 1), lambda t: (t, 0))],
        out_shape=[jax.ShapeDtypeStruct((tokens, hidden), FP8_DTYPE),
                   jax.ShapeDtypeStruct((tokens, 1), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="rmsnorm_quantize_fp8",
    )(x, weight.astype(x.dtype))
