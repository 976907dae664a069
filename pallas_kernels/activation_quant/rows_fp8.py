"""Per-token FP8 quantization of activations in one kernel (Pallas, Triton backend): the o
projection's input, the one W8A8 quantization in a decoder layer that no other kernel computes
(the RMSNorms' are rmsnorm_fp8.py's, the down projection's swiglu_fp8.py's).

In XLA it is two kernels: the row's absmax, and the conversion that reads the row again
(``benchmarks/step_kernels.py``). One program takes one token's row whole (H values in
registers) and writes its FP8 row and scale::

    grid = (T,)
    program t:  h = row t in float32
                scale[t] = max(|h|) / 448 (1 for an all-zero row);  out[t] = fp8(h / scale[t])

:func:`quantize_rows_fp8_kernel` has the signature of :func:`~.reference.quantize_rows_fp8`
(plus ``interpret``). The frame every per-token quantizing kernel shares (the row rule, the
row's FP8 store, the one-program-a-token call) is here too. The engine runs it on a GPU
(``JAXLLM_FP8_NORM_KERNEL``, ``jaxllm.layers.fp8_kernels``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .reference import FP8_DTYPE, FP8_MAX

NUM_WARPS = 4  # each per-token kernel: one program a token's row
MAX_HIDDEN = 16384  # a row in registers: 128 float32 a thread at 4 warps


def unsupported(x_shape: tuple[int, ...]) -> str | None:
    """Why a per-token kernel cannot take rows of this shape (None: it can): one row a
    block, in registers."""
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


def per_token_fp8_call(kernel, *, tokens: int, width: int, in_specs: list, name: str,
                       interpret: bool, num_warps: int = NUM_WARPS):
    """The pallas_call of a per-token quantizing kernel (this one, the norm's, SwiGLU's): one
    program a token (grid (T,)), writing the token's FP8 row [width] and its scale: outputs
    (float8_e4m3fn [T, width], f32 [T, 1])."""
    return pl.pallas_call(
        kernel,
        grid=(tokens,),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, width), lambda t: (t, 0)),
                   pl.BlockSpec((None, 1), lambda t: (t, 0))],
        out_shape=[jax.ShapeDtypeStruct((tokens, width), FP8_DTYPE),
                   jax.ShapeDtypeStruct((tokens, 1), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )


def _kernel(x_ref, out_ref, scale_ref):
    store_quantized_row(x_ref[...].astype(jnp.float32), out_ref, scale_ref)


@functools.partial(jax.jit, static_argnames=("interpret",))
def quantize_rows_fp8_kernel(
    h: jax.Array,  # [T, K]
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (float8_e4m3fn [T, K], f32 [T, 1])
    why = unsupported(h.shape)
    if why is not None:
        raise ValueError(why)
    tokens, k = h.shape
    return per_token_fp8_call(_kernel, tokens=tokens, width=k,
                              in_specs=[pl.BlockSpec((None, k), lambda t: (t, 0))],
                              name="quantize_rows_fp8", interpret=interpret)(h)
