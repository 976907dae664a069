"""The gated MLP ``down(silu(gate) up)`` over the model's fused ``gate_up`` projection, for any
weight format :func:`~jaxllm.layers.linear.linear` takes.

With FP8 W8A8 weights in both projections the steps between the two GEMMs (gate_up's scales,
SwiGLU, the down projection's per-token quantization) can run as one Pallas kernel
(``pallas_kernels/activation_quant``) instead of XLA's passes, which read gate_up's float32
product twice (RESULTS.md, 2026-12-04: 13% of an 8,192-token FP8 step). Off by default until
measured on a GPU in the engine: ``JAXLLM_FP8_SWIGLU_KERNEL`` picks it, ``f32`` or ``bf16``
naming the dtype the gate_up GEMM writes its product in (``off``: XLA's passes).
``benchmarks/fp8_mlp.py`` times every setting's block; ``h200_accept.sh``'s ``t1fs`` runs
the offline FP8 run with the faster one.
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.layers.linear import Fp8Weight, fp8_matmul, fp8_product, linear, quantize_tokens_fp8
from jaxllm.pallas_kernels.activation_quant import swiglu_quantize_fp8
from jaxllm.parallel.mesh import tensor_parallel_size

FP8_SWIGLU_KERNEL_ENV = "JAXLLM_FP8_SWIGLU_KERNEL"
FP8_SWIGLU_KERNELS = {"off": None, "f32": jnp.float32, "bf16": jnp.bfloat16}
# NOTE: not measured. Steps of fewer tokens keep XLA's passes: they are bound by launching
# their ~600-800 kernels (RESULTS.md, the FP8 decode steps), and a Pallas call splits XLA's
# command buffers where a fusion does not.
FP8_SWIGLU_KERNEL_MIN_TOKENS = 65


def fp8_swiglu_kernel_setting(environ=os.environ) -> str:
    """``JAXLLM_FP8_SWIGLU_KERNEL``'s value ("off" when unset); a clear error for any other."""
    value = environ.get(FP8_SWIGLU_KERNEL_ENV, "").strip() or "off"
    if value not in FP8_SWIGLU_KERNELS:
        raise ValueError(f"{FP8_SWIGLU_KERNEL_ENV}={value!r} must be one of "
                         f"{sorted(FP8_SWIGLU_KERNELS)}")
    return value


def fp8_swiglu_product_dtype(tokens: int, gate_up, down, mesh: Mesh | None = None,
                             setting: str | None = None):
    """Static: the dtype of gate_up's product the one-pass kernel reads for this projection
    pair, or None (XLA's passes): FP8 weights in both, at least
    :data:`FP8_SWIGLU_KERNEL_MIN_TOKENS` tokens, one device (a pallas_call is opaque to XLA's
    partitioner), and the kernel picked (``setting``, by default the environment's)."""
    product_dtype = FP8_SWIGLU_KERNELS[setting or fp8_swiglu_kernel_setting()]
    if (product_dtype is None or not isinstance(gate_up, Fp8Weight)
            or not isinstance(down, Fp8Weight) or gate_up.qt.ndim != 2
            or tokens < FP8_SWIGLU_KERNEL_MIN_TOKENS or tensor_parallel_size(mesh) != 1):
        return None
    return product_dtype


def swiglu_mlp(x: jax.Array, gate_up, down, *, mesh: Mesh | None = None,
               product_dtype=None) -> jax.Array:  # [T, H] -> [T, H] in x's dtype
    """``down(silu(gate) up)`` with gate_up's columns interleaved (gate_i, up_i). With
    ``product_dtype`` (:func:`fp8_swiglu_product_dtype`), both weights FP8: the one-pass
    kernel between the GEMMs (interpreted off the GPU)."""
    if product_dtype is None:
        y = linear(x, gate_up, mesh=mesh)  # [T, 2F]
        pairs = y.reshape(*y.shape[:-1], -1, 2)
        return linear(nn.silu(pairs[..., 0]) * pairs[..., 1], down, mesh=mesh)
    xq, x_scale = quantize_tokens_fp8(x)
    product = fp8_product(xq, gate_up, product_dtype)  # [T, 2F]
    hq, h_scale = swiglu_quantize_fp8(product, x_scale, gate_up.scale, x.dtype,
                                      interpret=jax.default_backend() != "gpu")
    return fp8_matmul(hq, h_scale, down, x.dtype)
