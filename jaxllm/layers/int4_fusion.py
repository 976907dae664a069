"""The 4-bit decode projections' launches folded into the GEMV and the norm before it
(``JAXLLM_INT4_FUSION``).

In the Llama-3-8B AWQ decode step at one row, 13 of a layer's 18 launches are small XLA
fusions around its 4 GEMVs and the attention kernel (``benchmarks/step_kernels.py``); three a
norm: the split sum of the projection before it, the residual add with the sum of squares,
and the normalization that writes the next GEMV's pre-scaled x. With
``JAXLLM_INT4_FUSION=on``, on one device, each RMSNorm before a 4-bit projection the GEMV
kernel takes (1-16 tokens, on a config that reads x pre-scaled) adds the block's output to
the residual stream, normalizes and writes the GEMV's pre-scaled x in one kernel
(``gemv_prescale.add_rmsnorm_prescale``; an :class:`Int4Activation`): one launch fewer a norm.
The unrolled layers then hand the next layer the MLP's output with the stream, unadded, as
vLLM's Llama does for its fused add + RMSNorm (``models.llama.DecoderLayer``). Likewise the
decode attention's split-K merge writes the o projection's pre-scaled x (``merge_prescale``,
where the GEMV's steps are one head each): one launch fewer a layer for XLA's merge and
prescale. And the qkv GEMV's split-K partials go unsummed to the RoPE + KV-write kernel, which
adds them itself (``rope_kv_write``; with ``JAXLLM_ROPE_KV_KERNEL``, no qkv bias): one launch
fewer a layer for XLA's sum (the 8B AWQ one-row step 425 -> 393 launches, compiled for the
H200 on the CPU; not yet timed).

On by default since the H100 timed it (RESULTS.md, 2026-12-06): the AWQ one-row step's
device time 2.989 -> 2.863 ms (2.798 with ``JAXLLM_ROPE_KV_KERNEL``), its kernels'
compiled tests passing; ``JAXLLM_INT4_FUSION=off`` gives XLA's passes back. Not the GEMVs
summing their own splits (``splits_sum="last"``), which would drop the split sums too: there
the GEMVs took 8.3 us a layer more, more than the XLA fusions they replaced. Read as the
forward is traced: part of the executable cache's key (``executable_cache.PROGRAM_ENV``).
"""

from __future__ import annotations

import os
from typing import Any

import flax.struct
import jax

from jaxllm.env_settings import env_switch
from jaxllm.pallas_kernels.quantized_matmul import gemv
from jaxllm.pallas_kernels.quantized_matmul.gemv_prescale import (
    add_rmsnorm_prescale,
    merge_prescale,
    rmsnorm_prescale,
)
from jaxllm.pallas_kernels.quantized_matmul.gemv_prescale import unsupported as norm_unsupported

INT4_FUSION_ENV = "JAXLLM_INT4_FUSION"


def fusion_enabled(environ=os.environ) -> bool:
    """Whether ``JAXLLM_INT4_FUSION`` is "on" (the default); a clear error for a value other
    than "on" or "off"."""
    return env_switch(environ, INT4_FUSION_ENV, default="on")


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


def norm_prescale_layout(x: jax.Array, kernel, uses_gemv: bool,
                         enabled: bool | None = None) -> tuple[int, bool] | None:
    """Static: (word rows a step, pairs) of the pre-scaled x the RMSNorm before this 4-bit
    projection writes (``x`` [T, K] its input, ``kernel`` an Int4Weight), or None (the norm
    writes x): the fusion on (``enabled``, by default the environment's), the projection
    through the GEMV (``uses_gemv``: linear.int4_kernel's answer) on a config reading x
    pre-scaled, and a row the norm kernel takes."""
    layout = _gemv_layout(x.shape[0], kernel, uses_gemv, enabled)
    if layout is None or norm_unsupported(x.shape, layout[0]) is not None:
        return None
    return layout


def attention_prescale_layout(tokens: int, kernel, head_dim: int, uses_gemv: bool,
                              enabled: bool | None = None) -> tuple[int, bool] | None:
    """Static: (word rows a step, pairs) of the pre-scaled x the decode attention's split
    merge writes for this 4-bit o projection (``kernel``), or None (it writes its output):
    the fusion on, the projection through the GEMV (``uses_gemv``) on a config reading x
    pre-scaled in steps of one head (D / 8 word rows)."""
    layout = _gemv_layout(tokens, kernel, uses_gemv, enabled)
    return layout if layout is not None and layout[0] * 8 == head_dim else None


def _gemv_layout(tokens: int, kernel, uses_gemv: bool,
                 enabled: bool | None) -> tuple[int, bool] | None:
    """The pre-scaled x's layout the GEMV reads for ``tokens`` tokens of this 4-bit projection,
    where the fusion is on (``enabled``, by default the environment's) and the projection goes
    through the GEMV (``uses_gemv``); else None."""
    enabled = fusion_enabled() if enabled is None else enabled
    if not (enabled and uses_gemv):
        return None
    k, n = kernel.shape
    # gemv's own pick, looked up there (step_profile --gemv-overrides patches it)
    return gemv.prescale_layout(gemv.gemv_config(tokens, k, n, kernel.group_size), k,
                                kernel.group_size)


def merged_prescaled(o: jax.Array, lse: jax.Array, dtype, pairs: bool,
                     interpret: bool) -> Int4Activation:
    """The decode kernel's split-K partials (o f32[T, K, Hq, D], lse f32[T, K, Hq]) merged
    into the o projection's pre-scaled x [T, Hq D]."""
    xs, xsum = merge_prescale(o, lse, dtype=dtype, pairs=pairs, interpret=interpret)
    return Int4Activation(xs, xsum, dtype, pairs)


def rmsnorm_prescaled(x: jax.Array, weight: jax.Array, eps: float, layout: tuple[int, bool],
                      interpret: bool, delta: jax.Array | None = None):
    """RMSNorm of ``x`` [T, H] (``weight`` [H]) as the GEMV's pre-scaled inputs, an
    :class:`Int4Activation`; with ``delta`` [T, H], of ``x + delta``: ``(x + delta, the
    activation)``."""
    step_words, pairs = layout
    common = dict(step_words=step_words, pairs=pairs, interpret=interpret)
    if delta is None:
        return Int4Activation(*rmsnorm_prescale(x, weight, eps, **common), x.dtype, pairs)
    stream, xs, xsum = add_rmsnorm_prescale(x, delta, weight, eps, **common)
    return stream, Int4Activation(xs, xsum, x.dtype, pairs)


def gemv_partial_splits(x: Int4Activation, kernel) -> int:
    """Static: how many float32 split partials the GEMV of ``x`` over this 4-bit ``kernel``
    leaves for XLA to sum (0: none; gemv.xla_summed_splits), which a kernel reading the
    projection's output may add itself instead (:func:`prescaled_gemv`'s partials)."""
    tokens, k = x.shape
    n = kernel.shape[1]
    return gemv.xla_summed_splits(gemv.gemv_config(tokens, k, n, kernel.group_size), k, n,
                                  kernel.group_size)


def prescaled_gemv(x: Int4Activation, kernel, interpret: bool,
                   partials: bool = False) -> jax.Array:
    """``x @ kernel`` [T, N] in x's dtype through the GEMV on its pick's config (``kernel``
    an Int4Weight); with ``partials``, its split-K partials unsummed, f32[S, T, N] (where
    :func:`gemv_partial_splits` counts S > 0)."""
    return gemv.int4_gemv_prescaled(x.xs, x.xsum, kernel.qweight, kernel.scales,
                                    kernel.zeros, dtype=x.dtype, pairs=x.pairs,
                                    group_size=kernel.group_size, interpret=interpret,
                                    partials=partials)
