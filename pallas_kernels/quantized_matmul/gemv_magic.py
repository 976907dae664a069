"""The 4-bit GEMV's loop before the denormal one (``Int4GemvConfig(denormal=False)``), and
its tensor-core variant (``dot=True``): gemv.py's kernel for those configs.

Per word row r of a step and nibble j, input row 8r + j::

    bits  = (word >> shift_j) & (0xF << p_j) | 0x4B000000     float32 2^23 + q 2^p_j, exact
    w     = bits - (2^23 + z[g, n] 2^p_j)                       (q - z) 2^p_j, exact
    part += (x[m, 8r + j] 2^-p_j) * w                           [M, rows, block_n] f32
    acc  += s[g, n] * part                                      once per step (one group)
    y     = sum over the step's rows of acc                     once per program

The OR with 2^23's bit pattern turns the nibble into a float without an int-to-float
conversion (a quarter-rate instruction on Hopper), and the nibble is masked where it sits
(p_j = 4j for j < 5; the upper three come from the word shifted by 12). The scale multiplies
a step's partial sums, not every weight: a step never crosses a group. At 1-2 tokens the
step's rows are reduced once at the end of the program; with more tokens that accumulator
would not fit in registers, so each step reduces its rows.

``dot=True`` swaps the FMAs for a tensor-core dot over rows padded to 16 (the same unpack).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .gemv_denormal import column_loads, fma
from .gemv_splits import write_rows
from .reference import PER_WORD

MAGIC = 0x4B000000  # float32 2^23: an integer OR-ed into its low mantissa bits reads exactly
TWO_23 = float(2**23)
HIGH_SHIFT = 12  # nibbles 5..7 are read from the word shifted by this (positions 8, 12, 16)


def nibble_position(j: int) -> tuple[int, int]:
    """(shift of the word, bit position of nibble j in the shifted word) with the position
    at most 16 so that ``nibble << position`` stays inside float32's 23-bit mantissa."""
    return (0, 4 * j) if 4 * j + 4 <= 20 else (HIGH_SHIFT, 4 * j - HIGH_SHIFT)


def magic_kernel(x_refs, w_ref, s_ref, z_ref, out_refs, *, n: int, steps: int,
                 step_words: int, group_words: int, dot: bool, reduce: bool, evict_first: bool,
                 dtype, out_n: int | None, mode: str, interpret: bool):
    # x_ref [M', K/8, 8] (all of x; M' = M, or padded to >= 16 rows for the dot);
    # w_ref i32[K/8/splits, block_n]; s_ref, z_ref [G, block_n]; out_refs:
    # gemv_splits.split_outputs' for ``mode`` (the dot: "one" or "xla", [M', block_n] blocks)
    [x_ref] = x_refs
    rows = x_ref.shape[0]
    block_n = w_ref.shape[1]
    cols, load = column_loads(n, block_n, evict_first)

    first_word = pl.program_id(1) * steps * step_words

    def step(i, acc):
        r0 = pl.multiple_of(i * step_words, step_words)  # word row within the split
        words = load(w_ref.at[pl.ds(r0, step_words), :], (cols < n)[None, :])  # i32[rows_w, bn]
        group = (first_word + r0) // group_words
        scale = load(s_ref.at[group, :], cols < n).astype(jnp.float32)  # [bn]
        zero = load(z_ref.at[group, :], cols < n).astype(jnp.float32)
        high = jnp.right_shift(words, HIGH_SHIFT)  # sign bits dragged in are masked off below
        row = first_word + r0
        # FMAs: one [rows_w, bn] partial per token, each in the words' own register layout (a
        # [M', rows_w, bn] product would make Triton move every unpacked tile through shared
        # memory to a 3-D layout); dot: one [M', bn] partial.
        parts = [None] * (1 if dot else rows)
        for j in range(PER_WORD):
            shift, pos = nibble_position(j)
            bits = ((high if shift else words) & (0xF << pos)) | MAGIC
            w = jax.lax.bitcast_convert_type(bits, jnp.float32) - (TWO_23 + zero * 2.0**pos)
            if dot:  # both operands exact in x's dtype (q - z has 5 bits)
                xj = x_ref[:, pl.ds(row, step_words), j].astype(jnp.float32) * 2.0**-pos
                terms = [jnp.dot(xj.astype(dtype), w.astype(dtype),
                                 preferred_element_type=jnp.float32)]  # [M', bn]
                parts = [t if p is None else p + t for p, t in zip(parts, terms, strict=True)]
            else:  # x * 2^-pos: exact, a power of two; [rows_w, bn] each
                xjs = [(x_ref[m, pl.ds(row, step_words), j].astype(jnp.float32)
                        * 2.0**-pos)[:, None] for m in range(rows)]
                parts = [xm * w if p is None else fma(xm, w, p, interpret)
                         for p, xm in zip(parts, xjs, strict=True)]
        if dot or reduce:
            parts = [p if dot else p.sum(axis=0) for p in parts]  # [M', bn] or [bn] each
            return tuple(a + scale * p for a, p in zip(acc, parts, strict=True))
        return tuple(a + scale[None, :] * p for a, p in zip(acc, parts, strict=True))

    if dot:
        shapes = [(rows, block_n)]
    else:
        shapes = [(block_n,) if reduce else (step_words, block_n)] * rows
    acc = jax.lax.fori_loop(0, steps, step, tuple(jnp.zeros(s, jnp.float32) for s in shapes))
    if dot:  # one [M', bn] tile (rows of a tensor cannot be taken apart in Triton)
        out_refs[0][...] = acc[0].astype(out_refs[0].dtype)
    else:
        ys = [a if reduce else a.sum(axis=0) for a in acc]
        write_rows(out_refs, ys, cols, mode=mode, out_n=out_n, interpret=interpret)
