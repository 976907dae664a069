"""4-bit weight GEMV over the N-major weight (int4 [N, K], K contiguous: the layout the Hopper
kernel reads), so that one copy of the weight serves the decode steps of a few tokens and the
Hopper kernel's larger ones (``jaxllm.layers.linear.Int4WeightNK``).

The weight's bytes are read as int32 words [N, K/8] (XLA's int4 packs element 8w + j of a row
in bits 4j..4j+3 of its word w; a bitcast, no copy), each nibble ``q - 8`` in two's complement,
i.e. ``q ^ 8``: one XOR a word gives back q. Then the product is gemv_denormal.py's: each
masked nibble read as a float32 subnormal against x scaled by a power of two, the zero point
taken out of the loop. A step is one [block_n, step_words] tile of words (16-byte loads along
K), its products taken nibble by nibble over the whole tile, so a step's loads all go out
before its first FMA (``Int4GemvConfig.loads_first``'s order)::

    grid = (cdiv(N, block_n), splits)
    program (c, s), step over word columns [w0, w0 + sw) of split s (one group a step):
        T      = words[c block_n .., w0 ..] ^ 0x88888888             i32[bn, sw], q nibbles
        part  += float(T & (0xF << p_j)) * xs[m, j, w0 ..][None, :]   x8 nibbles, [bn, sw]
        acc   += s[g][:, None] part;  corr += s[g] z[g] (sum of the step's x) 2^-X_EXP
    y[m] = (sum over sw of acc - corr) 2^X_EXP -> gemv_splits.write_rows (``splits_sum``)

x comes scaled per nibble position and laid out nibble-major (:func:`nibble_major_x`, [M, 8,
K/8]: a step's x of one nibble is one contiguous load a thread): one elementwise op for XLA
(in the compiled Llama-3-8B step fused into its producer for one projection of four, a small
kernel of its own for the others); the step's sum of x, for the zero points, is taken from
those same loads in the kernel (exact powers of two back), or by XLA before the call
(``x_sums_before``). FMAs grow with the tokens: this
serves 1-:data:`NK_GEMV_MAX_TOKENS` tokens (more: the Hopper kernel).
:func:`int4_gemv_nk` has the signature of :func:`~.hopper.int4_matmul_hopper_nk`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .gemv_denormal import X_EXP, column_loads, fma, nibble_as_float, scale_x, x_unit
from .gemv_splits import SPLITS_SUMS, auto_splits, split_outputs, write_rows
from .hopper import centred_zeros_of, n_major_operands
from .reference import PER_WORD, is_pow2
from .xla_int4 import CENTRE

NK_GEMV_MAX_TOKENS = 4  # FMAs a token: past a few tokens the Hopper kernel's tile wins
FLIP = -0x77777778  # 0x88888888 as an int32: XOR turns each nibble q - 8 back into q


@dataclasses.dataclass(frozen=True)
class Int4GemvNKConfig:
    """Tunables of the N-major GEMV (static: each distinct config is one compile)."""

    block_n: int = 256  # output columns (weight rows) per program
    num_warps: int = 4
    num_splits: int | None = None  # split-K partitions; None: auto
    target_programs: int = 512  # auto: double the splits while the grid is smaller than this
    max_splits: int = 32
    splits_sum: str = "xla"  # as Int4GemvConfig.splits_sum (gemv_splits.py)
    # x read by the kernel as it is and scaled per nibble position there (8 strided 2-byte
    # loads a word column a step instead of 8 16-byte ones of x pre-scaled by XLA): no XLA op
    # before the call (the pre-scaling is a kernel of its own for three of the 8B step's four
    # projections)
    x_in_kernel: bool = False
    # each step's sum of x (the zero points' share) taken by XLA before the call, f32[M, K/8/
    # step], one scalar load a step in the kernel, instead of a reduction across the program's
    # threads every step: compiled for sm_90 (gate_up, one token; kernel_sass --kernel
    # gemv_nk) its main loop loses its 4 shuffles, 742 -> 713 instructions a step (H100:
    # gate_up 46.1 -> 44.0 us, the other projections within 1 us either way)
    x_sums_before: bool = False
    # steps a loop iteration, their loads all issued before its first FMA: a weight row's next
    # 64 bytes (a group of 128) go out beside these (a 256-byte run at 4) instead of one
    # iteration later (H100, 4 steps over 128 columns and 8 warps: gate_up 46.1 -> 40.7 us,
    # still 1.35x the packed GEMV's 30.1; RESULTS.md 2026-12-07)
    unroll_steps: int = 1

    def __post_init__(self):
        for name in ("block_n", "max_splits", "num_warps", "unroll_steps"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)} must be a power of two")
        if self.num_splits is not None and not is_pow2(self.num_splits):
            raise ValueError(f"num_splits={self.num_splits} must be a power of two or None")
        if self.splits_sum not in SPLITS_SUMS:
            raise ValueError(f"splits_sum={self.splits_sum!r} must be one of {SPLITS_SUMS}")

    def splits(self, k: int, n: int, step_words: int) -> int:
        if self.num_splits is not None:
            return self.num_splits
        return auto_splits(k // PER_WORD // (step_words * self.unroll_steps),
                           pl.cdiv(n, self.block_n), self.max_splits, self.target_programs)


def nk_gemv_config(m: int) -> Int4GemvNKConfig:
    """The config for ``m`` tokens: each token keeps a [block_n, step] partial sum in
    registers, so the column block halves as the tokens double."""
    return Int4GemvNKConfig(block_n=256 // min(4, 1 << max(0, m - 1).bit_length()))


def step_words_of(group_size: int) -> int:
    """Word columns a step: the group's, at most 16 (a step never crosses a group)."""
    words = group_size // PER_WORD
    return min(16, words & -words)


def nk_gemv_unsupported(m: int, k: int, n: int, group_size: int,
                        config: Int4GemvNKConfig | None = None) -> str | None:
    """Why the N-major GEMV cannot take this shape (None: it can)."""
    config = config or nk_gemv_config(m)
    if not 1 <= m <= NK_GEMV_MAX_TOKENS:
        return f"{m} tokens: the N-major GEMV takes 1-{NK_GEMV_MAX_TOKENS}"
    if k % PER_WORD or group_size % PER_WORD or k % group_size:
        return f"group_size={group_size} must be a multiple of {PER_WORD} dividing K={k}"
    step = step_words_of(group_size)
    if step < 4:
        return f"group_size={group_size}: steps of {step} word columns are below a 16-byte load"
    splits = config.splits(k, n, step)
    if (k // PER_WORD) % (step * config.unroll_steps * splits):
        return (f"K/8={k // PER_WORD} is not a multiple of {step} word columns x "
                f"{config.unroll_steps} steps an iteration x {splits} splits")
    return None


def _unit(j: int, interpret: bool) -> int:
    """log2 of the power of two x[.., 8w + j] comes scaled by (gemv_denormal.x_unit without
    the byte permute: nibbles 6, 7 sit at bits 8, 12 of the word shifted by 16)."""
    return x_unit(0, j, pairs=False, interpret=interpret)


def nibble_major_x(x: jax.Array, interpret: bool) -> jax.Array:
    """x [M, K] -> f32[M, 8, K/8]: x[m, 8w + j] 2^unit_j at [m, j, w] (exact: powers of two),
    one elementwise op for XLA (which can fuse it into x's producer)."""
    m, k = x.shape
    unit = np.ldexp(np.float32(1), np.asarray([_unit(j, interpret) for j in range(PER_WORD)],
                                              np.int32)).astype(np.float32)
    return (x.astype(jnp.float32).reshape(m, k // PER_WORD, PER_WORD) * unit).transpose(0, 2, 1)


def _kernel(xs_ref, w_ref, s_ref, z_ref, sums_ref, *out_refs, n: int, steps: int,
            step_words: int, group_words: int, out_n: int | None, mode: str, interpret: bool,
            x_in_kernel: bool, unroll: int):
    # xs_ref f32[M, 8, K/8] (nibble_major_x: x scaled per nibble position; a step's sum of x
    # is taken from it in the kernel unless x_sums_before), or with x_in_kernel
    # x itself [M, K/8, 8] in its dtype (each nibble's x a strided load, scaled here);
    # w_ref i32[block_n, K/8/splits] (q - 8 nibbles); s_ref [G, block_n]; z_ref [G, block_n]
    # (z - 8 in the scales' dtype); sums_ref f32[M, K/8/step] each step's sum of x
    # (x_sums_before) or None; out_refs: gemv_splits.split_outputs' for ``mode``
    rows = xs_ref.shape[0]
    block_n = w_ref.shape[0]
    cols, load = column_loads(n, block_n, evict_first=False)
    first_word = pl.program_id(1) * steps * step_words

    def iteration(i, carry):
        acc, corr = carry
        loaded = []  # (first word, scale [bn], zero [bn], words [bn, sw]) each
        for u in range(unroll):
            r0 = pl.multiple_of((i * unroll + u) * step_words, step_words)
            group = (first_word + r0) // group_words
            scale = load(s_ref.at[group, :], cols < n).astype(jnp.float32)
            zero = load(z_ref.at[group, :], cols < n).astype(jnp.float32) + CENTRE
            words = load(w_ref.at[:, pl.ds(r0, step_words)], (cols < n)[:, None]) ^ FLIP
            loaded.append((first_word + r0, scale, zero, words))
        # nibble by nibble across the iteration's steps: its first FMA needs every step's
        # words, so all their loads go out before it
        highs = [jnp.right_shift(w, 16) for _, _, _, w in loaded]  # nibbles 6, 7 at bits 8..15
        parts = [[None] * rows for _ in loaded]
        xs = [[None] * rows for _ in loaded]
        for j in range(PER_WORD):
            for u, (word, _, _, words) in enumerate(loaded):
                src, pos = (words, 4 * j) if j < 6 else (highs[u], 4 * j - 16)
                w = nibble_as_float(src, pos, interpret)  # [bn, sw]
                for m in range(rows):
                    if x_in_kernel:  # x[m, 8w + j] for the step's w: 2-byte loads 16 bytes apart
                        x1 = xs_ref[m, pl.ds(word, step_words), j]
                        xj = scale_x(x1, _unit(j, interpret), interpret)  # [sw], x 2^unit_j
                        x1 = x1.astype(jnp.float32)
                    else:
                        xj = xs_ref[m, j, pl.ds(word, step_words)]  # [sw], x 2^unit_j
                        x1 = xj * 2.0**-_unit(j, interpret)  # x itself (exact)
                    xb = xj[None, :]  # [bn, sw] products
                    p = parts[u][m]
                    parts[u][m] = w * xb if p is None else fma(xb, w, p, interpret)
                    if sums_ref is None:
                        xs[u][m] = x1 if xs[u][m] is None else xs[u][m] + x1
        for u, (word, scale, zero, _) in enumerate(loaded):
            acc = tuple(a + scale[:, None] * p for a, p in zip(acc, parts[u], strict=True))
            sums = ([sums_ref[m, word // step_words] for m in range(rows)]
                    if sums_ref is not None else xs[u])
            corr = tuple(c + (scale * zero) * (x.sum() * 2.0**-X_EXP)
                         for c, x in zip(corr, sums, strict=True))
        return acc, corr

    init = (tuple(jnp.zeros((block_n, step_words), jnp.float32) for _ in range(rows)),
            tuple(jnp.zeros((block_n,), jnp.float32) for _ in range(rows)))
    acc, corr = jax.lax.fori_loop(0, steps // unroll, iteration, init)
    ys = [(a.sum(axis=1) - c) * 2.0**X_EXP for a, c in zip(acc, corr, strict=True)]
    write_rows(out_refs, ys, cols, mode=mode, out_n=out_n, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("group_size", "interpret", "config",
                                             "centred_zeros"))
def int4_gemv_nk(
    x: jax.Array,  # [.., K]
    weight: jax.Array,  # int4[N, K] (hopper.hopper_weight: q - 8, K contiguous)
    scales: jax.Array,  # [G, N]
    zeros: jax.Array,  # u8[G, N], or with centred_zeros z - 8 in the scales' dtype
    *,
    group_size: int,
    interpret: bool = False,
    config: Int4GemvNKConfig | None = None,
    centred_zeros: bool = False,
) -> jax.Array:  # [.., N] in x's dtype
    """Same contract as :func:`~.hopper.int4_matmul_hopper_nk`; raises ValueError for a shape
    :func:`nk_gemv_unsupported` names."""
    lead, x2, config = n_major_operands(x, weight, group_size, config,
                                        nk_gemv_config, nk_gemv_unsupported)
    m, k = x2.shape
    n = weight.shape[0]
    words = k // PER_WORD
    step = step_words_of(group_size)
    splits = config.splits(k, n, step)
    split_words = words // splits
    w32 = jax.lax.bitcast_convert_type(weight.reshape(n, words, PER_WORD), jnp.int32)  # bitcast
    if config.x_in_kernel:
        xs = x2.reshape(m, words, PER_WORD)  # x as it is (a bitcast)
    else:
        xs = nibble_major_x(x2, interpret)  # [M, 8, K/8]
    z = zeros if centred_zeros else centred_zeros_of(zeros, scales.dtype)
    operands = [xs, w32, scales, z]
    if config.x_sums_before:  # [M, K/8/step]
        operands.append(x2.astype(jnp.float32).reshape(m, words // step, step * PER_WORD)
                        .sum(axis=-1))
    mode = "one" if splits == 1 else config.splits_sum
    exact = mode in ("one", "last")
    outs = split_outputs(mode, splits=splits, rows=m, n=n, block_n=config.block_n,
                         dtype=x.dtype, exact=exact)
    kernel = functools.partial(
        _kernel, n=n, steps=split_words // step, step_words=step,
        group_words=group_size // PER_WORD, mode=mode, interpret=interpret,
        x_in_kernel=config.x_in_kernel, unroll=config.unroll_steps,
        out_n=n if exact and n % config.block_n else None)
    groups = scales.shape[0]
    in_specs = [
        pl.BlockSpec(xs.shape, lambda c, s: (0, 0, 0)),
        pl.BlockSpec((config.block_n, split_words), lambda c, s: (c, s)),
        pl.BlockSpec((groups, config.block_n), lambda c, s: (0, c)),
        pl.BlockSpec((groups, config.block_n), lambda c, s: (0, c)),
    ]
    if config.x_sums_before:
        in_specs.append(pl.BlockSpec(operands[-1].shape, lambda c, s: (0, 0)))
    sums = config.x_sums_before  # the fifth operand; without it None for the kernel's
    result = outs.pallas_call(
        lambda *refs: kernel(*refs[:4], refs[4] if sums else None, *refs[4 + sums:]),
        operands, in_specs,
        grid=(pl.cdiv(n, config.block_n), splits),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="int4_gemv_nk",
    )
    return outs.result(result, m, n, x.dtype).reshape(*lead, n)

