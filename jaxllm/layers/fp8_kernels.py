"""Which of the FP8 activation kernels (``pallas_kernels/activation_quant``) the model runs in
place of XLA's passes before an FP8 W8A8 projection, as the environment picks them.

A Pallas call replaces two or three of XLA's fusions a norm or an MLP
(``benchmarks/step_kernels.py`` counts them). Both run by default on a GPU (RESULTS.md): with
the norm kernel the H200's FP8 decode steps took 1.3-3.6% less device time at 1-64 rows and an
H100's offline sharegpt-like run was 1.7% faster (2026-12-06); the SwiGLU kernel, since it
holds the row in registers, made an H100's FP8 MLP block 1.6-10% faster than XLA's passes at
256-8,192 tokens (two runs, ``benchmarks/fp8_mlp.py``) and the offline run 1.8% faster, its
8,192-token steps 4.2% (2026-12-06).

- ``JAXLLM_FP8_SWIGLU_KERNEL`` = ``auto`` (``bf16`` on a GPU) | ``off`` | ``f32`` | ``bf16``:
  SwiGLU and the down projection's quantization in one kernel over gate_up's product, written
  by the FP8 GEMM in that dtype (:func:`jaxllm.layers.mlp.swiglu_mlp`);
- ``JAXLLM_FP8_NORM_KERNEL`` = ``auto`` (on a GPU) | ``off`` | ``on``: a layer's two
  RMSNorms and the next projection's quantization in one kernel each
  (:func:`rmsnorm_quantized`), and the o projection's input quantization, the layer's one
  other, in a kernel of its own (:func:`quantized_input`).

Either runs only on one device (a pallas_call is opaque to XLA's partitioner) and is
interpreted off the GPU (tests; "auto" keeps XLA's passes there). Read as the forward is
traced; part of the executable cache's key (``executable_cache.PROGRAM_ENV``).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.env_settings import env_choice
from jaxllm.layers.fp8 import Fp8Activation, Fp8Weight
from jaxllm.pallas_kernels.activation_quant import (
    quantize_rows_fp8_kernel,
    rmsnorm_fp8,
    rmsnorm_quantize_fp8,
    rows_fp8,
    swiglu_fp8,
)
from jaxllm.parallel.mesh import tensor_parallel_size

SWIGLU_KERNEL_ENV = "JAXLLM_FP8_SWIGLU_KERNEL"
SWIGLU_KERNELS = {"off": None, "f32": jnp.float32, "bf16": jnp.bfloat16}
NORM_KERNEL_ENV = "JAXLLM_FP8_NORM_KERNEL"
NORM_KERNELS = ("off", "on", "auto")


def swiglu_kernel_setting(environ=os.environ, backend: str | None = None) -> str:
    """``JAXLLM_FP8_SWIGLU_KERNEL``'s setting, "off", "f32" or "bf16"; "auto" (the default) is
    "bf16" on a GPU (``backend``, by default JAX's) and "off" elsewhere, where the kernel would
    run interpreted. A clear error for a value not listed."""
    setting = env_choice(environ, SWIGLU_KERNEL_ENV, (*SWIGLU_KERNELS, "auto"), default="auto")
    if setting == "auto":
        return "bf16" if _on_gpu(backend) else "off"
    return setting


def norm_kernel_enabled(environ=os.environ, backend: str | None = None) -> bool:
    """Whether the norm kernel runs: ``JAXLLM_FP8_NORM_KERNEL`` "on", or "auto" (the default)
    on a GPU (``backend``, by default JAX's); a clear error for a value not listed. Elsewhere
    "auto" keeps XLA's passes: the kernel would run interpreted."""
    setting = env_choice(environ, NORM_KERNEL_ENV, NORM_KERNELS, default="auto")
    if setting == "auto":
        return _on_gpu(backend)
    return setting == "on"


def _on_gpu(backend: str | None) -> bool:
    """What "auto" asks of either setting: ``backend`` (by default JAX's) is a GPU."""
    return (backend or jax.default_backend()) == "gpu"


def check_settings(environ=os.environ) -> None:
    """Both settings read once (the engine's start refuses a bad one before loading)."""
    swiglu_kernel_setting(environ)
    norm_kernel_enabled(environ)


def _one_device_fp8(kernel, mesh: Mesh | None) -> bool:
    return (isinstance(kernel, Fp8Weight) and kernel.qt.ndim == 2
            and tensor_parallel_size(mesh) == 1)


def swiglu_product_dtype(gate_up, down, mesh: Mesh | None = None, setting: str | None = None):
    """Static: the dtype of gate_up's product the one-pass SwiGLU kernel reads for this
    projection pair, or None (XLA's passes): FP8 weights in both on one device, a row the
    kernel holds, and the kernel picked (``setting``, by default the environment's)."""
    product_dtype = SWIGLU_KERNELS[setting or swiglu_kernel_setting()]
    if product_dtype is None or not (_one_device_fp8(gate_up, mesh)
                                     and _one_device_fp8(down, mesh)):
        return None
    if swiglu_fp8.unsupported((1, gate_up.shape[-1])) is not None:
        return None
    return product_dtype


def norm_quantizes(x: jax.Array, kernel, mesh: Mesh | None = None,
                   enabled: bool | None = None) -> bool:
    """Static: does the RMSNorm before this projection quantize its output in one kernel
    (:func:`rmsnorm_quantized`)? An FP8 projection on one device, a row the kernel takes, and
    the kernel picked (``enabled``, by default the environment's)."""
    enabled = norm_kernel_enabled() if enabled is None else enabled
    return (enabled and _one_device_fp8(kernel, mesh)
            and rmsnorm_fp8.unsupported(x.shape) is None)


def rmsnorm_quantized(x: jax.Array, weight: jax.Array, eps: float) -> Fp8Activation:
    """RMSNorm of ``x`` [T, H] (``weight`` [H]) quantized per token for an FP8 projection."""
    q, scale = rmsnorm_quantize_fp8(x, weight, eps, interpret=jax.default_backend() != "gpu")
    return Fp8Activation(q, scale, x.dtype)


def quantized_input(x: jax.Array, kernel, mesh: Mesh | None = None,
                    enabled: bool | None = None) -> jax.Array | Fp8Activation:
    """``x`` [T, K] quantized per token in one kernel for this FP8 projection, as an
    Fp8Activation; ``x`` itself (XLA's passes, in ``linear``) unless the kernel is picked
    (``enabled``, by default ``JAXLLM_FP8_NORM_KERNEL``), the projection FP8 on one device
    and the row one the kernel takes."""
    enabled = norm_kernel_enabled() if enabled is None else enabled
    if not (enabled and _one_device_fp8(kernel, mesh) and rows_fp8.unsupported(x.shape) is None):
        return x
    q, scale = quantize_rows_fp8_kernel(x, interpret=jax.default_backend() != "gpu")
    return Fp8Activation(q, scale, x.dtype)
