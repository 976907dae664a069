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
(plus ``interpret``). Not in the engine by default: the model runs it when
``JAXLLM_FP8_NORM_KERNEL=on`` (``jaxllm.layers.fp8_kernels``), until timed on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .reference import FP8_DTYPE
from .rmsnorm_fp8 import NUM_WARPS, store_quantized_row
from .rmsnorm_fp8 import unsupported as rows_unsupported


def unsupported(x_shape: tuple[int, ...]) -> str | None:
    """Why this kernel cannot take activations of this shape (None: it can)."""
    return rows_unsupported(x_shape)  # one row a block, as the norm kernel's


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
    return pl.pallas_call(
        _kernel,
        grid=(tokens,),
        in_specs=[pl.BlockSpec((None, k), lambda t: (t, 0))],
        out_specs=[pl.BlockSpec((None, k), lambda t: (t, 0)),
                   pl.BlockSpec((None, 1), lambda t: (t, 0))],
        out_shape=[jax.ShapeDtypeStruct((tokens, k), FP8_DTYPE),
                   jax.ShapeDtypeStruct((tokens, 1), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="quantize_rows_fp8",
    )(h)
