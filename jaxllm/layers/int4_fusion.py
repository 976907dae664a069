"""The 4-bit decode projections' launches folded into the GEMV and the norm before it
(``JAXLLM_INT4_FUSION``).

In the Llama-3-8B AWQ decode step at one row, 13 of a layer's 18 launches are small XLA
fusions around its 4 GEMVs and the attention kernel (``benchmarks/step_kernels.py``). With
``JAXLLM_INT4_FUSION=on``, on one device, for the projections the GEMV kernel takes (1-16
tokens, its configs that read x pre-scaled):

- each RMSNorm before a 4-bit projection writes the GEMV's pre-scaled x in one kernel
  (``gemv_prescale.rmsnorm_prescale``; an :class:`Int4Activation`) instead of XLA's sum of
  squares and normalization;
- each GEMV sums its split-K partials itself (``splits_sum="last"``) instead of XLA after
  the call;
- the o and down projections add the residual stream in that sum (one rounding, where XLA
  rounds the product, then the sum).

5 launches fewer a layer: 584 -> 424 at one row. Off by default until timed on a GPU. Read as
the forward is traced: part of the executable cache's key (``executable_cache.PROGRAM_ENV``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import flax.struct
import jax

from jaxllm.env_settings import env_switch
from jaxllm.pallas_kernels.quantized_matmul.gemv import (
    Int4GemvConfig,
    gemv_config,
    int4_gemv,
    int4_gemv_prescaled,
    prescale_layout,
)
from jaxllm.pallas_kernels.quantized_matmul.gemv_prescale import rmsnorm_prescale
from jaxllm.pallas_kernels.quantized_matmul.gemv_prescale import unsupported as norm_unsupported

INT4_FUSION_ENV = "JAXLLM_INT4_FUSION"


def fusion_enabled(environ=os.environ) -> bool:
    """Whether ``JAXLLM_INT4_FUSION`` is "on" ("off" when unset); a clear error for any other
    value."""
    return env_switch(environ, INT4_FUSION_ENV)


@flax.struct.dataclass
class Int4Activation:
    """Activations [T, K] already pre-scaled for a 4-bit GEMV (by the RMSNorm kernel that
    computed them): gemv_denormal.prescaled_inputs' layout for steps of ``K / 8 /
    xsum.shape[1]`` word rows."""

    xs: jax.Array  # f32 [T, K/8, 8]
    xsum: jax.Array  # f32 [T, K/8/step_words]
    dtype: Any = flax.struct.field(pytree_node=False)  # the activations' dtype: the output's
    pairs: bool = flax.struct.field(pytree_node=False, default=True)

    @property
    def shape(self) -> tuple[int, ...]:
        tokens, words, per_word = self.xs.shape
        return (tokens, words * per_word)


def fused_config(tokens: int, k: int, n: int, group_size: int) -> Int4GemvConfig:
    """The GEMV's config under the fusion: the table's, its splits summed in the kernel."""
    config = gemv_config(tokens, k, n, group_size)
    return config if config.dot else dataclasses.replace(config, splits_sum="last")


def norm_prescale_layout(x: jax.Array, kernel, uses_gemv: bool,
                         enabled: bool | None = None) -> tuple[int, bool] | None:
    """Static: (word rows a step, pairs) of the pre-scaled x the RMSNorm before this 4-bit
    projection writes (``x`` [T, K] its input, ``kernel`` an Int4Weight), or None (the norm
    writes x): the fusion on (``enabled``, by default the environment's), the projection
    through the GEMV (``uses_gemv``: linear.int4_kernel's answer) on a config reading x
    pre-scaled, and a row the norm kernel takes."""
    enabled = fusion_enabled() if enabled is None else enabled
    if not (enabled and uses_gemv):
        return None
    k, n = kernel.shape
    layout = prescale_layout(fused_config(x.shape[0], k, n, kernel.group_size), k,
                             kernel.group_size)
    if layout is None or norm_unsupported(x.shape, layout[0]) is not None:
        return None
    return layout


def rmsnorm_prescaled(x: jax.Array, weight: jax.Array, eps: float,
                      layout: tuple[int, bool], interpret: bool) -> Int4Activation:
    """RMSNorm of ``x`` [T, H] (``weight`` [H]) as the GEMV's pre-scaled inputs."""
    step_words, pairs = layout
    xs, xsum = rmsnorm_prescale(x, weight, eps, step_words=step_words, pairs=pairs,
                                interpret=interpret)
    return Int4Activation(xs, xsum, x.dtype, pairs)


def fused_gemv(x: jax.Array | Int4Activation, kernel, residual: jax.Array | None,
               interpret: bool) -> jax.Array:  # [T, N] in x's dtype
    """``x @ kernel (+ residual)`` through the GEMV with its splits summed in the kernel
    (``kernel`` an Int4Weight the GEMV takes at x's tokens)."""
    k, n = kernel.shape
    tokens = x.shape[0]
    config = fused_config(tokens, k, n, kernel.group_size)
    common = dict(group_size=kernel.group_size, interpret=interpret, config=config,
                  residual=residual)
    if isinstance(x, Int4Activation):
        return int4_gemv_prescaled(x.xs, x.xsum, kernel.qweight, kernel.scales, kernel.zeros,
                                   dtype=x.dtype, pairs=x.pairs, **common)
    return int4_gemv(x, kernel.qweight, kernel.scales, kernel.zeros, **common)
