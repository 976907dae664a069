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
:func:`~.reference.rmsnorm_quantize_fp8_reference`. The engine runs it on a GPU
(``JAXLLM_FP8_NORM_KERNEL``, ``jaxllm.layers.fp8_kernels``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .rows_fp8 import per_token_fp8_call, store_quantized_row, unsupported


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
    return per_token_fp8_call(kernel, tokens=tokens, width=hidden,
                              in_specs=[pl.BlockSpec((None, hidden), lambda t: (t, 0)),
                                        pl.BlockSpec((hidden,), lambda t: (0,))],
                              name="rmsnorm_quantize_fp8", interpret=interpret,
                              )(x, weight.astype(x.dtype))
