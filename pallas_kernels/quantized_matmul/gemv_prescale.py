"""An RMSNorm and the 4-bit GEMV's pre-scaled x in one kernel (Pallas, Triton backend).

Before a 4-bit projection of a few tokens XLA runs two kernels a norm: the row's sum of
squares, then the normalization, which also writes the GEMV's inputs
(gemv_denormal.prescaled_inputs: x scaled per nibble position, and each step's sum). In the
Llama-3-8B AWQ decode step at one row that is 4 of a layer's 18 launches
(``benchmarks/step_kernels.py``). One program takes one token's row whole (H values in
registers), laid out in the GEMV's steps; :func:`add_rmsnorm_prescale` first adds the
previous block's output to the residual stream and writes the sum (as vLLM's fused add +
RMSNorm: the add is then not a kernel of its own either)::

    grid = (T,)
    program t:  x = row t in float32, [K/8/step_words, 8 step_words]
                (x = round_dtype(x + delta[t]); stream[t] = x)
                h = round_dtype(round_dtype(x rsqrt(mean(x^2) + eps)) weight)   RMSNorm's
                xs[t] = h unit             unit: prescaled_inputs' power of two per column
                xsum[t, s] = sum over step s of h 2^-X_EXP

Each has the signature of its ``_reference``; the GEMV that reads their outputs is
:func:`~.gemv.int4_gemv_prescaled`. The sums' order differs from XLA's, so ``xsum`` and the
statistic may differ from the reference by float32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..activation_quant.reference import rmsnorm_reference
from ..paged_attention.decode import combine_splits
from .gemv_denormal import X_EXP, nibble_units, prescaled_inputs
from .reference import PER_WORD

NUM_WARPS = 4
MAX_HIDDEN = 16384  # a row in registers: 128 float32 a thread at 4 warps


def unsupported(x_shape: tuple[int, ...], step_words: int) -> str | None:
    """Why the kernel cannot take rows of this shape for a GEMV reading steps of
    ``step_words`` word rows (None: it can)."""
    if len(x_shape) != 2:
        return f"x {x_shape} must be [T, H]"
    hidden = x_shape[1]
    if hidden & (hidden - 1) or not 16 <= hidden <= MAX_HIDDEN:
        return f"hidden size {hidden} must be a power of two in [16, {MAX_HIDDEN}] (one block)"
    if hidden % (PER_WORD * step_words):
        return f"hidden size {hidden} is not a whole number of steps of {step_words} words"
    return None


def _units(step_words: int, pairs: bool, interpret: bool) -> np.ndarray:
    """f32[8 step_words]: the power of two each column of a step is scaled by (word row r's
    nibble j at column 8 r + j; with ``pairs`` the odd rows' top nibbles differ)."""
    rows = nibble_units(pairs, interpret)[:2 if pairs else 1]  # [2 or 1, 8]
    return np.tile(rows, (step_words // len(rows), 1)).reshape(-1)


def _kernel(*refs, eps: float, dtype, add: bool):
    # x_ref [steps, 8 step_words] (, delta_ref the same), weight_ref the same, unit_ref
    # [8 step_words] -> (stream_ref the same,) xs_ref f32 the same, xsum_ref f32 [steps]
    if add:
        x_ref, delta_ref, weight_ref, unit_ref, stream_ref, xs_ref, xsum_ref = refs
        stream = (x_ref[...].astype(jnp.float32) + delta_ref[...].astype(jnp.float32)) \
            .astype(dtype)  # the residual add, rounded as XLA's
        stream_ref[...] = stream
        x = stream.astype(jnp.float32)
    else:
        x_ref, weight_ref, unit_ref, xs_ref, xsum_ref = refs
        x = x_ref[...].astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x) + eps)
    h = (weight_ref[...] * normed.astype(dtype)).astype(jnp.float32)
    xs_ref[...] = h * unit_ref[...][None, :]
    xsum_ref[...] = (h * 2.0**-X_EXP).sum(axis=1)


def _call(x, delta, weight, eps: float, step_words: int, pairs: bool, interpret: bool):
    why = unsupported(x.shape, step_words)
    if why is not None:
        raise ValueError(why)
    tokens, hidden = x.shape
    steps, width = hidden // (PER_WORD * step_words), PER_WORD * step_words
    row = pl.BlockSpec((None, steps, width), lambda t: (t, 0, 0))
    rows = [x] if delta is None else [x, delta.astype(x.dtype)]
    stream = [jax.ShapeDtypeStruct((tokens, steps, width), x.dtype)] if delta is not None else []
    outs = pl.pallas_call(
        functools.partial(_kernel, eps=eps, dtype=x.dtype, add=delta is not None),
        grid=(tokens,),
        in_specs=[*[row] * len(rows), pl.BlockSpec((steps, width), lambda t: (0, 0)),
                  pl.BlockSpec((width,), lambda t: (0,))],
        out_specs=[*[row] * len(stream), row, pl.BlockSpec((None, steps), lambda t: (t, 0))],
        out_shape=[*stream, jax.ShapeDtypeStruct((tokens, steps, width), jnp.float32),
                   jax.ShapeDtypeStruct((tokens, steps), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="rmsnorm_prescale",
    )(*[r.reshape(tokens, steps, width) for r in rows],
      weight.astype(x.dtype).reshape(steps, width),
      jnp.asarray(_units(step_words, pairs, interpret)))
    *stream, xs, xsum = outs
    return (*[a.reshape(tokens, hidden) for a in stream],
            xs.reshape(tokens, hidden // PER_WORD, PER_WORD), xsum)


@functools.partial(jax.jit, static_argnames=("eps", "step_words", "pairs", "interpret"))
def rmsnorm_prescale(
    x: jax.Array,  # [T, H] the residual stream
    weight: jax.Array,  # [H] the norm's scale, in the model dtype
    eps: float,
    *,
    step_words: int,
    pairs: bool,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (xs f32[T, H/8, 8], xsum f32[T, H/8/step_words])
    return _call(x, None, weight, eps, step_words, pairs, interpret)


@functools.partial(jax.jit, static_argnames=("eps", "step_words", "pairs", "interpret"))
def add_rmsnorm_prescale(
    x: jax.Array,  # [T, H] the residual stream
    delta: jax.Array,  # [T, H] a block's output, added to it first
    weight: jax.Array,  # [H]
    eps: float,
    *,
    step_words: int,
    pairs: bool,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (x + delta [T, H] in x's dtype, xs, xsum)
    return _call(x, delta, weight, eps, step_words, pairs, interpret)


def rmsnorm_prescale_reference(
    x: jax.Array,  # [T, H]
    weight: jax.Array,  # [H]
    eps: float,
    *,
    step_words: int,
    pairs: bool,
    interpret: bool = False,  # the units of the GEMV's interpret mode (x_unit)
) -> tuple[jax.Array, jax.Array]:  # (xs f32[T, H/8, 8], xsum f32[T, H/8/step_words])
    """RMSNorm as ``models.llama.RMSNorm`` computes it (float32 statistics, the normalized row
    rounded to x's dtype, then times the weight in that dtype), then the GEMV's inputs as XLA
    writes them before the call (:func:`~.gemv_denormal.prescaled_inputs`)."""
    h = rmsnorm_reference(x, weight.astype(x.dtype), eps)
    tokens, hidden = x.shape
    return tuple(prescaled_inputs(h.reshape(tokens, hidden // PER_WORD, PER_WORD), step_words,
                                  pairs, interpret))


def add_rmsnorm_prescale_reference(
    x: jax.Array, delta: jax.Array, weight: jax.Array, eps: float, *, step_words: int,
    pairs: bool, interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (x + delta, xs, xsum)
    """The decoder layer's ``x + delta`` in x's dtype, then :func:`rmsnorm_prescale_reference`
    of it."""
    stream = x + delta.astype(x.dtype)
    return (stream, *rmsnorm_prescale_reference(stream, weight, eps, step_words=step_words,
                                                pairs=pairs, interpret=interpret))


def _merge_kernel(o_ref, lse_ref, unit_ref, xs_ref, xsum_ref, *, dtype):
    o = o_ref[...]  # f32[K, D]: split k's output, normalized over its own keys
    lse = lse_ref[...]  # f32[K]: its log2-sum-exp (-inf: no keys)
    top = jnp.max(lse)
    weight = jnp.exp2(lse - jnp.where(jnp.isfinite(top), top, 0.0))  # [K]; 0 for an empty split
    total = jnp.sum(weight)
    out = jnp.sum(weight[:, None] * o, axis=0) / jnp.where(total > 0, total, 1.0)  # [D]
    h = out.astype(dtype).astype(jnp.float32)
    xs_ref[...] = h * unit_ref[...]
    xsum_ref[...] = jnp.sum(h * 2.0**-X_EXP, keepdims=True)


@functools.partial(jax.jit, static_argnames=("dtype", "pairs", "interpret"))
def merge_prescale(
    o: jax.Array,  # f32[T, K, Hq, D] the decode kernel's split-K outputs
    lse: jax.Array,  # f32[T, K, Hq] their log2-sum-exp
    *,
    dtype,  # the attention output's dtype
    pairs: bool,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (xs f32[T, Hq D/8, 8], xsum f32[T, Hq])
    """The decode attention's splits merged (``paged_attention.decode.combine_splits``: online
    softmax's rescaling, the output rounded to ``dtype``) and written as the pre-scaled x of
    a GEMV whose steps are one head each (D / 8 word rows), in one kernel: one program a
    (token, head), where XLA runs the merge and the prescale as two."""
    tokens, splits, heads, head_dim = o.shape
    if head_dim & (head_dim - 1) or splits & (splits - 1) or head_dim < 16:
        raise ValueError(f"splits {splits} and head dim {head_dim} must be powers of two "
                         "(head dim >= 16)")
    xs, xsum = pl.pallas_call(
        functools.partial(_merge_kernel, dtype=dtype),
        grid=(tokens, heads),
        in_specs=[pl.BlockSpec((None, splits, None, head_dim), lambda t, h: (t, 0, h, 0)),
                  pl.BlockSpec((None, splits, None), lambda t, h: (t, 0, h)),
                  pl.BlockSpec((head_dim,), lambda t, h: (0,))],
        out_specs=[pl.BlockSpec((None, None, head_dim), lambda t, h: (t, h, 0)),
                   pl.BlockSpec((None, None, 1), lambda t, h: (t, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((tokens, heads, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((tokens, heads, 1), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="merge_prescale",
    )(o, lse, jnp.asarray(_units(head_dim // PER_WORD, pairs, interpret)))
    return xs.reshape(tokens, heads * head_dim // PER_WORD, PER_WORD), xsum[..., 0]


def merge_prescale_reference(o, lse, *, dtype, pairs: bool, interpret: bool = False):
    """XLA's: the splits merged (the decode kernel's ``combine_splits``), then
    :func:`~.gemv_denormal.prescaled_inputs` in steps of one head."""
    tokens, _, heads, head_dim = o.shape
    out = combine_splits(o, lse, dtype).reshape(tokens, heads * head_dim // PER_WORD, PER_WORD)
    return tuple(prescaled_inputs(out, head_dim // PER_WORD, pairs, interpret))
