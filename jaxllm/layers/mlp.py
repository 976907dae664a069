"""The gated MLP ``down(silu(gate) up)`` over the model's fused ``gate_up`` projection, for any
weight format :func:`~jaxllm.layers.linear.linear` takes.

With FP8 W8A8 weights in both projections the steps between the two GEMMs (gate_up's scales,
SwiGLU, the down projection's per-token quantization) can run as one Pallas kernel
(``pallas_kernels/activation_quant``) instead of XLA's passes, which read gate_up's product
twice: ``JAXLLM_FP8_SWIGLU_KERNEL`` (:mod:`jaxllm.layers.fp8_kernels`; on by default on a GPU,
over the GEMM's bf16 product). ``benchmarks/fp8_mlp.py`` times every setting's block.
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.sharding import Mesh

from jaxllm.layers.fp8 import Fp8Activation, fp8_matmul, fp8_product, quantize_tokens_fp8
from jaxllm.layers.linear import linear
from jaxllm.pallas_kernels.activation_quant import swiglu_quantize_fp8


def swiglu_mlp(x: jax.Array | Fp8Activation, gate_up, down, *, mesh: Mesh | None = None,
               product_dtype=None) -> jax.Array:  # [T, H] -> [T, H] in x's dtype
    """``down(silu(gate) up)`` with gate_up's columns interleaved (gate_i, up_i). With
    ``product_dtype`` (:func:`~jaxllm.layers.fp8_kernels.swiglu_product_dtype`), both weights
    FP8: the one-pass kernel between the GEMMs (interpreted off the GPU)."""
    if product_dtype is None:
        y = linear(x, gate_up, mesh=mesh)  # [T, 2F]
        pairs = y.reshape(*y.shape[:-1], -1, 2)
        return linear(nn.silu(pairs[..., 0]) * pairs[..., 1], down, mesh=mesh)
    xq, x_scale = (x.q, x.scale) if isinstance(x, Fp8Activation) else quantize_tokens_fp8(x)
    product = fp8_product(xq, gate_up, product_dtype)  # [T, 2F]
    hq, h_scale = swiglu_quantize_fp8(product, x_scale, gate_up.scale, x.dtype,
                                      interpret=jax.default_backend() != "gpu")
    return fp8_matmul(hq, h_scale, down, x.dtype)
