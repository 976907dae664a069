"""FP8 W8A8 projections: the weight's format and the per-token activation quantization.

:class:`Fp8Weight`: FP8 W8A8 (``--quantization fp8``, as vLLM's dynamic FP8): the weight in
``float8_e4m3fn`` with one scale per output channel, quantized at load time and stored
transposed, [.., N, K]; each token's activations are quantized to ``float8_e4m3fn`` with
their own scale as the layer runs, and the product of the two FP8 operands accumulates in
float32 (on Hopper, cuBLASLt's FP8 GEMM); both scales multiply the [.., N] output. The
transposed weight is why the GEMM is fast: cuBLASLt's FP8 GEMM takes both operands K-major,
and with the kernel's own [K, N] layout XLA transposed it every call (H200, Llama-3-8B's
gate_up at 256 tokens: 1,031 us against 151 us K-major and 272 us for bf16;
``benchmarks/fp8_matmul.py``, RESULTS).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxllm.pallas_kernels.activation_quant import FP8_DTYPE, FP8_MAX, quantize_rows_fp8


def absmax_scale(x: jax.Array, axis: int, limit: float) -> jax.Array:
    """absmax / limit along ``axis`` (float32; 1 where everything is zero)."""
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis)
    return jnp.where(absmax > 0, absmax / limit, 1.0)


@flax.struct.dataclass
class Fp8Weight:
    """Stands in for a kernel [.., K, N], stored transposed (K-major, as the FP8 GEMM reads
    it)."""

    qt: jax.Array  # float8_e4m3fn [.., N, K]
    scale: jax.Array  # float32 [.., N]: W[k, n] ~= qt[n, k] * scale[n]

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, k = self.qt.shape
        return (*lead, k, n)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.qt.astype(dtype) * self.scale[..., :, None].astype(dtype)).swapaxes(-1, -2)


@flax.struct.dataclass
class Fp8Activation:
    """Activations [T, K] already quantized per token for an FP8 projection (by the kernel
    that also computed them: ``jaxllm.layers.fp8_kernels``): x ~= q x scale."""

    q: jax.Array  # float8_e4m3fn [T, K]
    scale: jax.Array  # f32 [T, 1]
    dtype: Any = flax.struct.field(pytree_node=False)  # the activations' dtype: the output's

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape


def quantize_fp8(kernel: jax.Array) -> Fp8Weight:
    """Per-output-channel FP8 (e4m3) of a kernel [.., K, N]: each column scaled so its
    largest magnitude is e4m3's largest value."""
    scale = absmax_scale(kernel, -2, FP8_MAX)  # [.., N]
    q = jnp.clip(kernel.astype(jnp.float32) / scale[..., None, :], -FP8_MAX, FP8_MAX)
    return Fp8Weight(qt=q.astype(FP8_DTYPE).swapaxes(-1, -2), scale=scale)


def quantize_tokens_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each token's activations [.., K] in ``float8_e4m3fn`` with their own scale (absmax /
    448): ``(xq [.., K], x_scale f32 [.., 1])``, x ~= xq x_scale."""
    return quantize_rows_fp8(x)


def fp8_product(xq: jax.Array, kernel: Fp8Weight, out_dtype=jnp.float32) -> jax.Array:
    """The FP8 GEMM of quantized activations [.., K] and an FP8 weight, unscaled: [.., N] in
    ``out_dtype`` (the GEMM accumulates in float32 whatever it writes)."""
    return jax.lax.dot_general(xq, kernel.qt,
                               (((xq.ndim - 1,), (kernel.qt.ndim - 1,)), ((), ())),
                               preferred_element_type=out_dtype)


def fp8_matmul(xq: jax.Array, x_scale: jax.Array, kernel: Fp8Weight, dtype) -> jax.Array:
    """``x @ W`` from quantized activations (:func:`quantize_tokens_fp8`): [.., N] in
    ``dtype``, both scales applied in float32 to the GEMM's product written in ``dtype``: with a
    bf16 product the passes after it (the scales, SwiGLU, the next quantization's absmax) read
    half the bytes, which made the H200's FP8 MLP block 4-10% faster than over a float32 product
    at 256-8,192 tokens, at the same distance from bf16 (RESULTS.md, 2026-12-05, m8)."""
    product = fp8_product(xq, kernel, dtype).astype(jnp.float32)
    return (product * x_scale * kernel.scale).astype(dtype)
