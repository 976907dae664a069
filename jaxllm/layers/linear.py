"""The one linear layer: every projection of the model calls :func:`linear`, whatever its
weight's format, so the model code does not change with quantization.

A weight is either a float kernel [K, N] (``y = x @ W``) or a quantized pytree that stands in
for it at the same place in the param tree and shards the same way (its [.., K, N] parts split
as the kernel, its per-output-channel parts as the kernel's output axis):

- :class:`Int8Weight`: int8 weight-only, one symmetric scale per output channel, quantized at
  load time (``--quantization int8``). The int8 values are widened to the activation dtype
  inside the matmul's fusion; the scale multiplies the [.., N] output, not the weight.
- :class:`~jaxllm.layers.fp8.Fp8Weight`: FP8 W8A8 (``--quantization fp8``), in
  :mod:`jaxllm.layers.fp8` with the per-token activation quantization.
- :class:`Int4Weight`: 4-bit weight-only with a scale and a zero point per group of input rows
  and output column, read from AWQ and GPTQ checkpoints
  (:mod:`jaxllm.quantization.int4_checkpoint` repacks both into this one layout). It stays
  packed on the device. On a GPU, a projection of at most :data:`INT4_GEMV_MAX_TOKENS`
  tokens runs the GEMV kernel of ``pallas_kernels/quantized_matmul`` (each packed word read
  once, FMAs), and one of at most :data:`INT4_KERNEL_MAX_TOKENS` its tiled matmul kernel;
  both dequantize in registers (decode reads a quarter of bf16's bytes); with
  ``JAXLLM_INT4_HOPPER=on`` the weights are stored N-major instead (:class:`Int4WeightNK`)
  and a Hopper GPU runs 1-4 tokens through the N-major GEMV, up to
  :data:`INT4_HOPPER_MAX_TOKENS` through one Mosaic GPU kernel and more through XLA;
  ``JAXLLM_INT4_HOPPER=both`` keeps both layouts (``Int4Weight.n_major``) and gives the GEMV's
  tokens to the packed words, the Mosaic GPU kernel's to the N-major copy (the default,
  ``auto``, keeps both on a Hopper GPU where the copy is small beside the card).
  Elsewhere, for more tokens, under tensor parallelism, or for a shape the kernels cannot
  tile, XLA dequantizes the whole weight and dots it (the kernels' reference: CPU results are
  that path's).
"""

from __future__ import annotations

import os
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.env_settings import env_choice
from jaxllm.layers.fp8 import (
    Fp8Activation,
    Fp8Weight,
    absmax_scale,
    fp8_matmul,
    quantize_tokens_fp8,
)
from jaxllm.layers.int4_fusion import Int4Activation, prescaled_gemv
from jaxllm.pallas_kernels.quantized_matmul import (
    PER_WORD,
    dequantize_int4,
    gemv_unsupported,
    int4_gemv,
    int4_matmul,
    int4_matmul_reference,
    unsupported,
)
from jaxllm.pallas_kernels.quantized_matmul.gemv_nk import int4_gemv_nk, nk_gemv_unsupported
from jaxllm.pallas_kernels.quantized_matmul.hopper import (
    centred_zeros_of,
    hopper_weight,
    int4_matmul_hopper_nk,
)
from jaxllm.pallas_kernels.quantized_matmul.hopper import unsupported as hopper_unsupported
from jaxllm.pallas_kernels.quantized_matmul.reference import dequantize_nibbles
from jaxllm.parallel.mesh import tensor_parallel_size

INT8_MAX = 127


@flax.struct.dataclass
class Int8Weight:
    """Stands in for a kernel [.., K, N]."""

    q: jax.Array  # int8 [.., K, N]
    scale: jax.Array  # float [.., N]: W[k, n] ~= q[k, n] * scale[n]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return self.q.astype(dtype) * self.scale[..., None, :].astype(dtype)


def quantize_int8(kernel: jax.Array) -> Int8Weight:
    """Symmetric per-output-channel int8 of a kernel [.., K, N] (absmax / 127 per column;
    an all-zero column gets scale 1)."""
    scale = absmax_scale(kernel, -2, INT8_MAX)  # [.., N]
    q = jnp.clip(jnp.round(kernel.astype(jnp.float32) / scale[..., None, :]), -INT8_MAX,
                 INT8_MAX).astype(jnp.int8)
    return Int8Weight(q=q, scale=scale.astype(kernel.dtype))


def in_dtype(x, dtype):
    """A layer's input in its dtype; activations already quantized or pre-scaled (from that
    dtype) as they are."""
    return x if isinstance(x, (Fp8Activation, Int4Activation)) else x.astype(dtype)


@flax.struct.dataclass
class Int4Weight:
    """Stands in for a kernel [.., K, N] whose K input rows form G = K / g groups of g rows::

        qweight  i32[.., K/8, N]  row r holds input rows 8r..8r+7, row 8r+j in bits 4j..4j+3
        scales   f[.., G, N]      compute dtype
        zeros    u8[.., G, N]     effective zero points, 0..16 (GPTQ v1's +1 already added)

        W[k, n] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]

    Packing along K (as GPTQ does) keeps whole output columns in each word, so the fused
    projections' column orders and a tensor-parallel split of either axis select words.

    ``n_major``: the same weight also stored N-major (``JAXLLM_INT4_HOPPER=both``, made at
    load by :func:`int4_n_major`; "auto" on a Hopper GPU): projections of more tokens than the
    GEMV's, up to :data:`INT4_HOPPER_MAX_TOKENS`, read that copy instead (the Hopper kernel);
    None keeps the packed words only."""

    qweight: jax.Array
    scales: jax.Array
    zeros: jax.Array
    n_major: Int4WeightNK | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, words, n = self.qweight.shape
        return (*lead, words * PER_WORD, n)

    @property
    def group_size(self) -> int:
        return self.shape[-2] // self.scales.shape[-2]

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_int4(self.qweight, self.scales, self.zeros, dtype)


@flax.struct.dataclass
class Int4WeightNK:
    """An :class:`Int4Weight` with its nibbles stored as XLA's int4 [N, K] (q - 8, K
    contiguous): the layout the Hopper kernel reads as wgmma's register operand. Made at load
    from Int4Weight by :func:`int4_n_major` under ``JAXLLM_INT4_HOPPER=on`` (one device,
    unrolled layers); the same bytes as the packed words, which it replaces."""

    w: jax.Array  # int4 [N, K]
    scales: jax.Array  # [G, N] as Int4Weight's
    zeros: jax.Array  # [G, N] the zero points minus 8, in the scales' dtype (exact)

    @property
    def shape(self) -> tuple[int, ...]:
        n, k = self.w.shape
        return (k, n)

    @property
    def group_size(self) -> int:
        return self.shape[-2] // self.scales.shape[-2]

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        # (q - 8) - (z - 8): both centred, the same integers as q - z
        return dequantize_nibbles(self.w.T.astype(jnp.int32), self.scales, self.zeros, dtype)


# JAXLLM_INT4_HOPPER=on: on a Hopper GPU the 4-bit weights are stored N-major at load
# (Int4WeightNK) and every 4-bit projection runs over them: the N-major GEMV at 1-4 tokens
# (gemv_nk.py), the Mosaic GPU kernel above (pallas_kernels/quantized_matmul/hopper.py, the
# weight as wgmma's register operand), instead of the GEMV, the tiled Triton kernel and XLA's
# dequantize and dot. Alone on the H200 the Hopper kernel beat XLA's path 3.2x at 128 tokens
# and lost to the GEMV at 1-16 (RESULTS.md, 2026-12-05, i5); through the engine on the H100
# (2026-12-07) "on" made the offline run 1.15x faster but the one-row step ~32% slower (the
# N-major GEMV reads its weight at ~3/4 the packed one's rate). JAXLLM_INT4_HOPPER=both keeps
# the packed words beside the N-major copy (the 4-bit weights' bytes twice: +3.5 GB for
# Llama-3-8B): 1-16 tokens read the packed words with every fusion of the packed-only layout,
# 17 to INT4_HOPPER_MAX_TOKENS the copy (the Hopper kernel), more the packed words (XLA). On
# an H100 (2026-12-07, 0ba3d45) it gave the offline run 1.16x ("off" 8,951 output tok/s,
# "both" 10,366) and the one-row step the same device time (2.76 against 2.77 ms). The
# default, "auto" (jaxllm/engine/int4_layout.py), keeps both where that copy is small beside
# a Hopper card, the packed words only elsewhere.
# Read where the engine loads, so listed among the executable cache's program variables
# (executable_cache.PROGRAM_ENV).
INT4_HOPPER_ENV = "JAXLLM_INT4_HOPPER"
INT4_LAYOUTS = ("off", "on", "both")  # what a loaded model holds
INT4_HOPPER_MODES = (*INT4_LAYOUTS, "auto")


def int4_hopper_mode(environ=os.environ) -> str:
    """``JAXLLM_INT4_HOPPER``'s value: "auto" (unset: "both" where it pays, "off" elsewhere:
    :mod:`jaxllm.engine.int4_layout`), "off" (the packed words only), "on" (N-major only) or
    "both"; a clear error for any other value."""
    return env_choice(environ, INT4_HOPPER_ENV, INT4_HOPPER_MODES, default="auto")


def int4_n_major(params: Any, *, donate: bool = False, keep_packed: bool = False) -> Any:
    """``params`` with every one-layer :class:`Int4Weight` (2-D words: the unrolled layout)
    as an :class:`Int4WeightNK` (new arrays; the scales shared), or with ``keep_packed`` as
    the Int4Weight with that copy in its ``n_major``. ``donate`` (without ``keep_packed``):
    the caller owns ``params``, so each packed weight is freed once its N-major copy is made
    (the conversion then holds one projection twice at most, not the whole model: +35 GB for
    a 70B model)."""
    n_major = jax.jit(hopper_weight)
    made: dict[int, jax.Array] = {}  # id of packed words -> their N-major copy (shared words)

    def convert(leaf):
        if isinstance(leaf, Int4Weight) and leaf.qweight.ndim == 2:
            if id(leaf.qweight) not in made:
                made[id(leaf.qweight)] = n_major(leaf.qweight)
                if donate and not keep_packed:  # freed once the conversion has read it
                    jax.block_until_ready(made[id(leaf.qweight)])
                    leaf.qweight.delete()
            copy = Int4WeightNK(made[id(leaf.qweight)], leaf.scales,
                                centred_zeros_of(leaf.zeros, leaf.scales.dtype))
            if keep_packed:
                return leaf.replace(n_major=copy)
            return copy
        return leaf

    return jax.tree.map(convert, params, is_leaf=lambda x: isinstance(x, Int4Weight))


def one_layout(params: Any) -> Any:
    """``params`` without the N-major copies kept beside packed words (``n_major``): the
    weights one step reads, whichever of the two layouts each projection takes."""
    return jax.tree.map(lambda leaf: leaf.replace(n_major=None) if isinstance(leaf, Int4Weight)
                        else leaf, params, is_leaf=lambda x: isinstance(x, Int4Weight))


def _int4_nk_matmul(x: jax.Array, kernel: Int4WeightNK, backend: str) -> jax.Array:
    """An N-major 4-bit projection where the kernels run (a GPU, or interpreted): the N-major
    GEMV for a few tokens, the Hopper kernel for more; else its weight dequantized one layer
    at a time and dotted by XLA."""
    k, n = kernel.shape
    tokens = x.size // k
    interpret = backend == "pallas_interpret"
    if backend != "xla" and nk_gemv_unsupported(tokens, k, n, kernel.group_size) is None:
        return int4_gemv_nk(x, kernel.w, kernel.scales, kernel.zeros,
                            group_size=kernel.group_size, centred_zeros=True, interpret=interpret)
    if (backend != "xla" and tokens <= INT4_HOPPER_MAX_TOKENS
            and hopper_unsupported(tokens, k, n, kernel.group_size) is None):
        return int4_matmul_hopper_nk(x, kernel.w, kernel.scales, kernel.zeros,
                                     group_size=kernel.group_size, centred_zeros=True,
                                     interpret=interpret)
    x, weight = _after_input(x, kernel)
    return _n_major_dequantized_dot(x, weight)


def _n_major_dequantized_dot(x: jax.Array, kernel: Int4WeightNK) -> jax.Array:
    """``x @ W`` with W dequantized as it is stored, [N, K], and contracted on its K: cuBLAS
    takes a transposed operand, so no [K, N] copy is transposed first. The same products in
    x's dtype as :meth:`Int4WeightNK.dequantize`."""
    n, k = kernel.w.shape
    groups = kernel.scales.shape[-2]
    nibbles = kernel.w.astype(jnp.int32).reshape(n, groups, k // groups)  # [N, G, g]
    weight = ((nibbles - kernel.zeros.T[..., None].astype(jnp.int32)).astype(x.dtype)
              * kernel.scales.T[..., None].astype(x.dtype)).reshape(n, k)
    return jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())))


# Token counts up to this run the 4-bit kernel on a GPU; more go through XLA's dequantize and
# cuBLAS, where the weight is read once for many tokens and the kernel's small tiles lose.
INT4_KERNEL_MAX_TOKENS = 64
# Token counts up to this run the GEMV kernel instead (each packed word read once, split-K;
# FMAs below 4 tokens, a dot over rows padded to 16 from 4). NOTE: 16 because it is the dot's
# row tile (more tokens, more tiles: the tiled kernel's job), not a measurement:
# benchmarks/int4_matmul.py prints both kernels at 1, 4 and 16 tokens.
INT4_GEMV_MAX_TOKENS = 16
# N-major weights (JAXLLM_INT4_HOPPER=on): token counts up to this run the Hopper kernel; more
# go through XLA's dequantize and cuBLAS. Measured through the engine on the H100
# (RESULTS.md, 2026-12-07, t1a against t1ah): the Hopper kernel's decode steps of 257-512
# rows took 22.5 ms against 25.8 for XLA's path, of 513-1024 rows 39.0 against 37.8, and the
# 8,192-token mixed steps 290 against 200.
INT4_HOPPER_MAX_TOKENS = 512
INT4_BACKENDS = ("auto", "xla", "pallas", "pallas_interpret")


def resolve_int4_backend(backend: str) -> str:
    """``backend`` with "auto" resolved: "pallas" when tracing for a GPU (the default
    backend), else "xla"."""
    if backend not in INT4_BACKENDS:
        raise ValueError(f"int4 backend {backend!r} must be one of {INT4_BACKENDS}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return backend


def int4_kernel(x: jax.Array, kernel: Int4Weight, backend: str = "auto",
                mesh: Mesh | None = None) -> str | None:
    """Static: which Pallas kernel :func:`linear` runs this 4-bit projection through: "gemv",
    "matmul", or None (XLA's dequantize and dot). "auto" means "pallas" when tracing for a GPU
    (the default backend), else "xla"."""
    backend = resolve_int4_backend(backend)
    tokens = x.size // x.shape[-1]
    *lead, k, n = kernel.shape
    # Under tensor parallelism the weight is sharded and a pallas_call is opaque to XLA's
    # partitioner (it would gather the whole weight onto every device): sharded projections
    # keep XLA's path until the kernel is wrapped in shard_map per split (columns: local;
    # rows: local, then psum).
    if backend == "xla" or lead or tensor_parallel_size(mesh) != 1:
        return None
    if tokens <= INT4_GEMV_MAX_TOKENS and gemv_unsupported(tokens, k, n,
                                                           kernel.group_size) is None:
        return "gemv"
    if tokens <= INT4_KERNEL_MAX_TOKENS and unsupported(tokens, k, n, kernel.group_size) is None:
        return "matmul"
    return None


def int4_uses_kernel(x: jax.Array, kernel: Int4Weight, backend: str = "auto",
                     mesh: Mesh | None = None) -> bool:
    """Static: does :func:`linear` run this 4-bit projection through a Pallas kernel?"""
    return int4_kernel(x, kernel, backend, mesh) is not None


def _after_input(x: jax.Array, weight) -> tuple[jax.Array, object]:
    """``(x, weight)``, the weight not available before ``x``. A dequantized weight does not
    depend on the activations, so XLA may schedule every layer's dequantization of an unrolled
    forward before the first layer runs and keep them all live: the Llama-3-70B AWQ forward at
    2,048 tokens asked 35.6 GiB of temporaries on the H200 (~one bf16 copy of 80 layers' down
    projections), the CPU's grew by one layer's bf16 weights per layer. The barrier makes each
    dequantization wait for its own layer's input, so one layer's copy is live at a time. The
    caller must use both outputs: with x's output unused XLA dropped the barrier where it had
    fused x's producer into the GEMM (every gate_up after an RMSNorm; 27.8 GiB of
    temporaries in the compiled H200 program, RESULTS.md 2026-12-05)."""
    return jax.lax.optimization_barrier((x, weight))


def linear(x: jax.Array | Fp8Activation | Int4Activation, kernel, *,
           int4_backend: str = "auto", mesh: Mesh | None = None) -> jax.Array:
    """``x @ kernel`` ([.., K] -> [.., N] in x's dtype) for a float or quantized kernel (an
    FP8 one may take activations already quantized, :class:`Fp8Activation`; a 4-bit one
    pre-scaled for its GEMV, :class:`~jaxllm.layers.int4_fusion.Int4Activation`).
    ``int4_backend`` ("auto", "xla", "pallas", "pallas_interpret") and ``mesh`` (the params'
    mesh) pick a 4-bit kernel's path (:func:`int4_kernel`)."""
    backend = resolve_int4_backend(int4_backend)
    if isinstance(x, Int4Activation):
        if not isinstance(kernel, Int4Weight):
            raise TypeError(f"pre-scaled activations need a 4-bit weight, got "
                            f"{type(kernel).__name__}")
        return prescaled_gemv(x, kernel, interpret=backend == "pallas_interpret")
    if isinstance(x, Fp8Activation):
        if not isinstance(kernel, Fp8Weight):
            raise TypeError(f"FP8 activations need an FP8 weight, got {type(kernel).__name__}")
        return fp8_matmul(x.q, x.scale, kernel, x.dtype)
    if isinstance(kernel, Fp8Weight):
        return fp8_matmul(*quantize_tokens_fp8(x), kernel, x.dtype)
    if isinstance(kernel, Int4WeightNK):
        return _int4_nk_matmul(x, kernel, backend)
    if isinstance(kernel, Int4Weight):
        parts = (x, kernel.qweight, kernel.scales, kernel.zeros)
        path = int4_kernel(x, kernel, backend, mesh)
        # both layouts: the Hopper kernel's tokens on the N-major copy; past them XLA's
        # dequantize and dot of the packed words (as fast as of the copy through the engine,
        # RESULTS.md 2026-12-07, and 255 fewer launches in the 8,192-token step)
        if (kernel.n_major is not None and path != "gemv" and backend != "xla"
                and x.size // x.shape[-1] <= INT4_HOPPER_MAX_TOKENS):
            return _int4_nk_matmul(x, kernel.n_major, backend)
        impl = {"gemv": int4_gemv, "matmul": int4_matmul}.get(path)
        if impl is not None:
            return impl(*parts, group_size=kernel.group_size,
                        interpret=backend == "pallas_interpret")
        x, weight = _after_input(x, parts[1:])
        return int4_matmul_reference(x, *weight, group_size=kernel.group_size)
    if isinstance(kernel, Int8Weight):
        x, q = _after_input(x, kernel.q)
        return jnp.dot(x, q.astype(x.dtype)) * kernel.scale.astype(x.dtype)
    return jnp.dot(x, kernel.astype(x.dtype))


class Linear(nn.Module):
    """``nn.Dense``'s params (``kernel`` [K, N], ``bias`` [N]), computed by :func:`linear`, so
    the kernel may be a quantized weight."""

    features: int
    use_bias: bool
    dtype: jnp.dtype
    mesh: Mesh | None = None  # tensor parallel: the params' mesh (a 4-bit kernel's path)

    @nn.compact
    def __call__(self, x: jax.Array | Fp8Activation | Int4Activation) -> jax.Array:
        shape = (x.shape[-1], self.features)
        kernel = self.get_variable("params", "kernel")
        if isinstance(kernel, (Int4Weight, Int4WeightNK, Fp8Weight)):
            # Flax's param() checks the first leaf's shape: the packed words [K/8, N], the
            # transposed FP8 weight [N, K].
            assert kernel.shape == shape, (kernel.shape, shape)
        else:
            kernel = self.param("kernel", nn.initializers.lecun_normal(), shape, self.dtype)
        y = linear(in_dtype(x, self.dtype), kernel, mesh=self.mesh)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y
