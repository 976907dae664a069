"""The GEMV's FMA inner loop at one LOP3 and one FFMA a weight (``Int4GemvConfig.denormal``).

A masked nibble left where it sits in its word, ``bits = word & (0xF << p)``, is below
float32's exponent field (p <= 20: the field is 0 or 1), and such a bit pattern reads as the
float ``bits 2^-149`` exactly (the subnormals and the first normal binade are one linear
range). So with x scaled by ``2^(149 - p - X_EXP)`` (a power of two: exact), one FFMA adds
``q x 2^-X_EXP`` with no conversion and no bias to subtract. The zero point leaves the loop:
sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k), with sum_k x_k once per step::

    per word row r, column n:   part[n] += xs[r, j] * float(word[r, n] & (0xF << p_j))  x8
    per step (one group):       acc[n]  += s[g, n] part[n];  corr[n] += s z[g, n] xsum[step]
    per program:                y[n]     = (acc[n] - corr[n]) 2^X_EXP

Each word row is a [block_n] vector in one layout (4 consecutive columns a thread, as the
words are loaded), so the scale, the zeros and every partial sum share it: no layout
conversion through shared memory and no cross-thread reduction of the products; x is one
scalar load and one integer op (the exponent add, :func:`scale_x`) a thread per (row,
nibble), shared by the thread's columns. Nibbles 6, 7 (bits 24..31 would reach the exponent)
come from one ``prmt`` per pair of word rows. By default XLA scales x and sums each step's
before the call (one small fusion; :func:`prescaled_inputs`); with
``Int4GemvConfig.x_in_kernel`` x comes in as it is and each thread scales what it reads (one
integer op a thread per (row, nibble) more, no XLA op before the call), which made the
engine's AWQ step slower on the H200 (the config's note).

Needs float32 subnormals kept (no flush-to-zero): Triton emits ``fma.rn.f32``, and XLA's
GPU compile flushes only with ``--xla_gpu_ftz``. XLA:CPU flushes them, so interpret mode
converts ``q`` instead (the same products).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .gemv_splits import write_rows
from .reference import PER_WORD

SUBNORMAL = 149  # float32 bits b < 2^24 (exponent field 0 or 1) read as b 2^-149
X_EXP = 64  # partial sums carry 2^-64: xs = x 2^(85 - p) stays finite for |x| < 2^43


def _top_bytes(even, odd, interpret: bool):
    """Byte 3 of ``even`` in bits 0..7 and of ``odd`` in bits 16..23 (bits 8..15 and 24..31
    are copies the nibble masks drop): one PRMT (``prmt.b32`` with selector 0x7733)."""
    if interpret:
        return (jnp.right_shift(even, 24) & 0xFF) | (jnp.right_shift(odd, 8) & 0xFF0000)
    [top] = pltriton.elementwise_inline_asm(
        "prmt.b32 $0, $1, $2, 0x7733;", args=[even, odd], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(even.shape, jnp.int32)])
    return top


def denormal_nibbles(words: list, r: int, pairs: bool, interpret: bool) -> list[tuple]:
    """(source, bit position) of nibbles 0..7 of ``words[r]`` for the denormal path: nibbles
    0..5 in place (bits 0..23: a float32 whose exponent field is 0 or 1 reads exactly as bits
    2^-149); nibbles 6, 7 from the top bytes of rows r and r ^ 1 packed into one word (one
    byte permute a pair of words; positions 0, 4 for the even row, 16, 20 for the odd), or
    with ``pairs`` False from the word shifted right by 16 (positions 8, 12)."""
    word = words[r]
    if pairs:
        even, odd = (word, words[r + 1]) if r % 2 == 0 else (words[r - 1], word)
        top = _top_bytes(even, odd, interpret)
        base = 0 if r % 2 == 0 else 16
        return [(word, 4 * j) for j in range(6)] + [(top, base), (top, base + 4)]
    high = jnp.right_shift(word, 16)
    return [(word, 4 * j) for j in range(6)] + [(high, 8), (high, 12)]


def nibble_unit(r: int, j: int, pairs: bool) -> int:
    """The bit position of nibble j of word row r in denormal_nibbles."""
    if j < 6:
        return 4 * j
    return (4 * (j - 6) + (16 if r % 2 else 0)) if pairs else 4 * (j - 6) + 8


def column_loads(n: int, block_n: int, evict_first: bool):
    """This program's output columns i32[block_n] and ``load(ref, mask)``: a plain load unless
    the grid's last column block is partial (masked, zeros past N; static) or the weights
    should leave the cache first."""
    cols = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    tail = n % block_n != 0

    def load(ref, mask):
        if not tail and not evict_first:
            return ref[...]
        return pltriton.load(ref, mask=mask if tail else None, other=0 if tail else None,
                             eviction_policy="evict_first" if evict_first else None)

    return cols, load


def x_unit(r: int, j: int, pairs: bool, interpret: bool) -> int:
    """log2 of the power of two x[m, 8r + j] is scaled by: SUBNORMAL - X_EXP - p for nibble
    j's bit position p in word row r (r's parity, with ``pairs``). Interpret mode: -X_EXP only
    (the kernel converts q itself there; a constant 2^-149 would be flushed)."""
    return (0 if interpret else SUBNORMAL - nibble_unit(r, j, pairs)) - X_EXP


def scale_x(x, unit: int, interpret: bool):
    """x (a float32 or bfloat16 scalar) times 2^unit as a float32, exactly for normal |x| <
    2^(128 - unit): the unit added to x's exponent field, with the bf16 -> f32 widening one
    integer op (the shift) and no multiply. A zero or subnormal x comes out as a float32 of
    magnitude < 2^(unit - 126) instead of its (zero or < 2^(unit - 126)) value: times a
    nibble's float32 (< 2^(p - 145)) that is below 2^(-190): the product rounds to zero, as
    the exact one does, and adds nothing to a sum. Interpret mode: a multiply (unit -64; an
    exponent add would underflow a small x's)."""
    if interpret:
        return x.astype(jnp.float32) * 2.0**unit
    if x.dtype == jnp.bfloat16:  # bf16 bits are the top half of the float32's
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32) << 16
    else:
        bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jax.lax.bitcast_convert_type(bits + (unit << 23), jnp.float32)


def fma(a, b, c, interpret: bool):
    """a * b + c as one ``fma.rn.f32`` a element (a, b, c f32 of one shape, or a a scalar).
    XLA compiles Pallas' Triton kernels without floating-point contraction, so a multiply and
    an add stay two instructions (FMUL, FADD in the sm_90 SASS of the engine's GEMV: 3.5
    instructions a weight where the FMA makes it 2.5). With x in bf16 the GEMVs' products
    are exact (a nibble times an 8-bit mantissa), so the fused form rounds as the two did."""
    if interpret:
        return a * b + c
    a = jnp.broadcast_to(a, c.shape)
    [out] = pltriton.elementwise_inline_asm(
        "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.float32)])
    return out


def launch_dependents(values, interpret: bool):
    """``values`` (float32) unchanged, after ``griddepcontrol.launch_dependents``: this
    program lets the kernel after it be launched now (under programmatic dependent launch;
    else a no-op). Its dependents still wait for this kernel's completion where they start
    (XLA puts ``griddepcontrol.wait`` there), so where it runs changes no result. The values
    pass through the instruction so that it is kept."""
    if interpret:
        return values
    [out] = pltriton.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", args=[values],
        constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(values.shape, jnp.float32)])
    return out


def nibble_as_float(src, pos: int, interpret: bool):
    """The nibble at bits pos..pos+3 of ``src`` (int32) as a float32: its masked bits read as
    one, q 2^(pos - 149) exactly (pos <= 20), no conversion instruction. Interpret mode: q
    itself (XLA:CPU flushes subnormals to zero; x is scaled by 2^-X_EXP only, x_unit)."""
    bits = src & (0xF << pos)
    if interpret:
        return jnp.right_shift(bits, pos).astype(jnp.float32)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _products(words: list, pairs: bool, interpret: bool, loads_first: bool):
    """(word row r, nibble j, source, bit position) of the step's products in the order they
    join the partial sums: row by row (each row's nibbles unpacked as it comes), or nibble by
    nibble over all of the step's rows (``loads_first``: nibble 0 of every word row first, so
    all of the step's words are needed at once and ptxas issues all of its loads before the
    first FMA, not one or two just ahead of their products)."""
    if loads_first:
        nibbles = [denormal_nibbles(words, r, pairs, interpret) for r in range(len(words))]
        for j in range(PER_WORD):
            for r in range(len(words)):
                yield (r, j, *nibbles[r][j])
    else:
        for r in range(len(words)):
            for j, (src, pos) in enumerate(denormal_nibbles(words, r, pairs, interpret)):
                yield r, j, src, pos


def denormal_kernel(x_refs, w_ref, s_ref, z_ref, out_refs, *, n: int, steps: int,
                    step_words: int, group_words: int, evict_first: bool, interpret: bool,
                    pairs: bool, prefetch: bool, out_n: int | None, mode: str,
                    prescaled: bool, loads_first: bool = False,
                    trigger_dependents: bool = False):
    # x_ref [M, K/8, 8] in x's dtype (all of x; each thread reads it as scalars, once per
    # (row, nibble), and scales it in registers; the threads sum each step's together), or
    # with ``prescaled`` xs_ref f32[M, K/8, 8] and xg_ref f32[M, K/8/step_words] from
    # :func:`prescaled_inputs`; w_ref i32[K/8/splits, block_n]; s_ref, z_ref [G, block_n];
    # out_refs: gemv_splits.split_outputs' for ``mode``
    x_ref = x_refs[0]
    rows = x_ref.shape[0]
    block_n = w_ref.shape[1]
    cols, load = column_loads(n, block_n, evict_first)

    first_word = pl.program_id(1) * steps * step_words

    def load_words(i):  # a step's word rows, i32[bn] each (i traced: the masked load of a
        # partial column block takes no Python int index in interpret mode)
        r0 = pl.multiple_of(jnp.asarray(i, jnp.int32) * step_words, step_words)
        return tuple(load(w_ref.at[r0 + r, :], cols < n) for r in range(step_words))

    def step(i, carry):
        acc, corr, ahead = carry
        r0 = pl.multiple_of(i * step_words, step_words)
        row = first_word + r0  # a multiple of step_words: even with pairs (x_unit's parity)
        group = row // group_words
        scale = load(s_ref.at[group, :], cols < n).astype(jnp.float32)  # [bn]
        zero = load(z_ref.at[group, :], cols < n).astype(jnp.float32)
        parts = [None] * rows
        # the step's x summed by all threads together (one load of the rows and a reduction,
        # not an add a thread per (row, nibble)), f32 scalars
        if prescaled:
            xsum = [x_refs[1][m, row // step_words] for m in range(rows)]
        else:
            xsum = [x_ref[m, pl.ds(row, step_words), :].astype(jnp.float32).sum() * 2.0**-X_EXP
                    for m in range(rows)]
        if prefetch:  # this step's words came with the carry; ask for the next step's now
            # (the last step re-reads its own: in bounds, and cached)
            words, ahead = ahead, load_words(jnp.minimum(i + 1, steps - 1))
        else:
            words = load_words(i)
        for r, j, src, pos in _products(words, pairs, interpret, loads_first):
            w = nibble_as_float(src, pos, interpret)
            for m in range(rows):
                xs = x_ref[m, row + r, j] if prescaled else scale_x(
                    x_ref[m, row + r, j], x_unit(r, j, pairs, interpret), interpret)
                # q x 2^-X_EXP, [bn]
                parts[m] = xs * w if parts[m] is None else fma(xs, w, parts[m], interpret)
        acc = tuple(a + scale * p for a, p in zip(acc, parts, strict=True))
        corr = tuple(c + (scale * zero) * xs for c, xs in zip(corr, xsum, strict=True))
        return acc, corr, ahead

    zeros = tuple(jnp.zeros((block_n,), jnp.float32) for _ in range(rows))
    if trigger_dependents:  # (through the sums' first value: an instruction that is kept)
        zeros = tuple(launch_dependents(z, interpret) for z in zeros)
    init = (zeros, zeros, load_words(0) if prefetch else ())
    acc, corr, _ = jax.lax.fori_loop(0, steps, step, init)
    ys = [(a - c) * 2.0**X_EXP for a, c in zip(acc, corr, strict=True)]
    write_rows(out_refs, ys, cols, mode=mode, out_n=out_n, interpret=interpret)


def nibble_units(pairs: bool, interpret: bool) -> np.ndarray:
    """f32[2, 8]: the power of two x[m, 8r + j] is scaled by, for r's parity and nibble j
    (:func:`x_unit`; the odd row differs only with ``pairs``)."""
    units = [[x_unit(r, j, pairs, interpret) for j in range(PER_WORD)] for r in range(2)]
    return np.ldexp(np.float32(1), np.asarray(units, np.int32)).astype(np.float32)


def prescaled_inputs(x: jax.Array, step_words: int, pairs: bool,
                     interpret: bool) -> list[jax.Array]:
    """x [M, K/8, 8] -> [xs f32[M, K/8, 8], xsum f32[M, K/8/step_words]]: x scaled per nibble
    position and its per-step sums times 2^-X_EXP, by XLA before the call (one small fusion;
    ``Int4GemvConfig.x_in_kernel`` False)."""
    rows, words, _ = x.shape
    unit = nibble_units(pairs, interpret)
    x32 = x.astype(jnp.float32)
    # The power of two inside the sum (the same value while no term falls below 2^-62): XLA
    # then writes both inputs from one fusion instead of following the sums with a multiply.
    xsum = (x32 * 2.0**-X_EXP).reshape(rows, words // step_words, -1).sum(-1)
    if pairs:  # steps of an even number of word rows: K/8 is even
        xs = (x32.reshape(rows, words // 2, 2, PER_WORD) * unit).reshape(x.shape)
    else:
        xs = x32 * unit[0]
    return [xs, xsum]
