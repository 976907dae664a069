"""The references of the activation quantization kernels: what the model runs in XLA before an
FP8 W8A8 projection (``jaxllm.layers.linear``, ``models.llama``), bit for bit.

- :func:`swiglu_quantize_fp8_reference` (:func:`~.swiglu_fp8.swiglu_quantize_fp8`): the FP8
  MLP's steps between its two GEMMs;
- :func:`rmsnorm_quantize_fp8_reference` (:func:`~.rmsnorm_fp8.rmsnorm_quantize_fp8`): a
  decoder layer's RMSNorm and the next projection's per-token quantization."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

# The FP8 format of W8A8 projections (jaxllm.layers.linear takes these from here)
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448


def quantize_rows_fp8(h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row of ``h`` [.., K] in ``float8_e4m3fn`` with its own scale (absmax / 448, 1 for an
    all-zero row), computed in float32: ``(q [.., K], scale f32 [.., 1])``, h ~= q x scale. The
    model's per-token activation quantization (``jaxllm.layers.linear.quantize_tokens_fp8``)."""
    h = h.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(h), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
    return jnp.clip(h / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE), scale


def swiglu_quantize_fp8_reference(
    product: jax.Array,  # [T, 2F] the gate_up FP8 GEMM's unscaled product (gate_i, up_i pairs)
    x_scale: jax.Array,  # f32 [T, 1]: gate_up's per-token activation scales
    w_scale: jax.Array,  # f32 [2F]: gate_up's per-channel weight scales
    dtype,  # the model's activation dtype
    interpret: bool = False,  # the kernel's signature; unused
) -> tuple[jax.Array, jax.Array]:  # (float8_e4m3fn [T, F], f32 [T, 1])
    """gate_up's output ``(product x_scale w_scale)`` in ``dtype``, SwiGLU's ``silu(gate) up``
    in ``dtype``, then the down projection's input quantized per token (absmax / 448)."""
    del interpret
    y = (product.astype(jnp.float32) * x_scale * w_scale).astype(dtype)
    pairs = y.reshape(*y.shape[:-1], -1, 2)
    return quantize_rows_fp8(nn.silu(pairs[..., 0]) * pairs[..., 1])


def rmsnorm_quantize_fp8_reference(
    x: jax.Array,  # [T, H] the residual stream
    weight: jax.Array,  # [H] the norm's scale, in the model dtype
    eps: float,
    interpret: bool = False,  # the kernel's signature; unused
) -> tuple[jax.Array, jax.Array]:  # (float8_e4m3fn [T, H], f32 [T, 1])
    """RMSNorm as ``models.llama.RMSNorm`` computes it (float32 statistics, the normalized row
    rounded to x's dtype, then times the weight in that dtype), quantized per token (absmax /
    448) as :func:`jaxllm.layers.linear.quantize_tokens_fp8` does."""
    del interpret
    return quantize_rows_fp8(rmsnorm_reference(x, weight, eps))


def rmsnorm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:  # [T, H]
    """RMSNorm of ``x`` [T, H] as ``models.llama.RMSNorm`` computes it: float32 statistics,
    the normalized row rounded to x's dtype, then times ``weight`` [H] (the model dtype)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)
