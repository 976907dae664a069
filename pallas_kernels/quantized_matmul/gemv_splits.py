"""How the GEMV's split-K partial sums become its result (``Int4GemvConfig.splits_sum``).

Program (c, s) ends with f32 sums ``ys[m]`` [block_n] of its word rows for columns
[c block_n, ..). Then, with M' rows (M; the dot pads to >= 16) and N' = whole column blocks::

    one split   store ys in x's dtype into y [M, N] (masked past N): the call's result
    "xla"       store ys into P[s] of f32 P [splits, M', N']; XLA sums P over the splits (a
                fixed order: deterministic) and slices and casts: one fusion after the call
    "atomic"    add ys into one f32 [M, N'] with atomic adds; XLA zeroes it before the call
                (a memset) and casts after (fusable into the consumer). The additions' order
                follows the programs' timing: not bit-for-bit reproducible (each result
                within float32 rounding, ~splits eps32 sum_s |P[s]|, of the fixed order's;
                the sm_90 atomic add also flushes subnormal sums to zero)
    "last"      store ys into P[s], then count the split done on column block c's counter (an
                atomic add; XLA zeroes the counters before the call, a memset); the split that
                counts last sums P[0] + P[1] + .. in split order and stores y in x's dtype:
                deterministic whichever split ends last, no XLA op after the call

"last" orders the partials' stores before the count as CUTLASS's split-K semaphore does: a
barrier of the program's threads, then the count with release semantics (Triton's atomic is
acq_rel at GPU scope); the last split reads P after its count's acquire, with volatile loads
(not from L1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

SPLITS_SUMS = ("xla", "atomic", "last")


def auto_splits(steps: int, col_blocks: int, max_splits: int, target_programs: int) -> int:
    """Split-K count for a GEMV of ``steps`` steps a column block: doubled while it divides
    the steps, stays within ``max_splits`` and the grid has fewer than ``target_programs``
    programs (enough for the GPU's SMs at few columns)."""
    splits = 1
    while (splits * 2 <= max_splits and steps % (splits * 2) == 0
           and col_blocks * splits < target_programs):
        splits *= 2
    return splits


def _store_row(o_ref, m: int, value, cols, out_n: int | None):
    """Row m in o_ref's dtype, masked past column out_n (None: the output is whole column
    blocks wide). A [1, bn] view: the interpreter's masked store takes no integer index."""
    if out_n is None:
        o_ref[m, :] = value.astype(o_ref.dtype)
    else:
        pltriton.store(o_ref.at[pl.ds(m, 1), :], value.astype(o_ref.dtype)[None, :],
                       mask=(cols < out_n)[None, :])


def write_rows(out_refs, ys, cols, *, mode: str, out_n: int | None, interpret: bool):
    """The program's rows ``ys`` (f32 [block_n] each) into its outputs, by ``mode`` ("one",
    or a splits_sum) as the module docstring draws."""
    if mode == "one" or mode == "xla":
        for m, y in enumerate(ys):
            _store_row(out_refs[0], m, y, cols, out_n)
    elif mode == "atomic":
        for m, y in enumerate(ys):  # [1, bn]: the interpreter's atomic takes no integer index
            pltriton.atomic_add(out_refs[0], (pl.ds(m, 1), slice(None)), y[None, :])
    else:
        o_ref, count_ref, part_ref = out_refs  # y [M, bn]; i32[col blocks]; P [splits, M, bn]
        splits = part_ref.shape[0]
        for m, y in enumerate(ys):
            part_ref[pl.ds(pl.program_id(1), 1), pl.ds(m, 1), :] = y[None, None, :]
        if not interpret:  # every thread's partial stored before the count's release
            pltriton.debug_barrier()
        done = pltriton.atomic_add(count_ref, (pl.program_id(0),), jnp.int32(1))

        @pl.when(done == splits - 1)
        def _sum_splits():
            for m in range(len(ys)):
                y = None
                for t in range(splits):  # split order, whichever split came last
                    p = pltriton.load(part_ref.at[pl.ds(t, 1), pl.ds(m, 1), :],
                                      volatile=not interpret)[0, 0]
                    y = p if y is None else y + p
                _store_row(o_ref, m, y, cols, out_n)


@dataclasses.dataclass(frozen=True)
class SplitOutputs:
    """The pallas_call's outputs for a mode: shapes, specs, zeroed buffers aliased to them."""

    mode: str
    shapes: tuple  # jax.ShapeDtypeStruct each
    specs: tuple  # pl.BlockSpec each, over grid (c, s)
    zeros: tuple  # (input array, output index) each: passed after the weights, aliased

    def pallas_call(self, kernel, operands: list, in_specs: list, **kwargs):
        """``pl.pallas_call`` of ``kernel(*operand_refs, *output_refs)`` over ``operands`` and
        this mode's outputs, ``kwargs`` (grid, compiler params, ..) passed on. The zeroed
        buffers go in after the operands, aliased to their outputs, and are dropped from the
        kernel's refs (it writes their outputs)."""
        n = len(operands)

        def flat(*refs):
            kernel(*refs[:n], *refs[n + len(self.zeros):])

        return pl.pallas_call(
            flat,
            in_specs=[*in_specs, *[self.specs[i] for _, i in self.zeros]],
            out_specs=self.specs,
            out_shape=self.shapes,
            input_output_aliases={n + j: i for j, (_, i) in enumerate(self.zeros)},
            **kwargs,
        )(*operands, *[a for a, _ in self.zeros])

    def result(self, outs, m: int, n: int, dtype) -> jax.Array:  # [M, N] in dtype
        y = outs[0]
        if self.mode == "xla":
            y = y.sum(axis=0)
        if y.shape != (m, n):
            y = y[:m, :n]
        return y.astype(dtype)


def split_outputs(mode: str, *, splits: int, rows: int, n: int, block_n: int,
                  dtype, exact: bool) -> SplitOutputs:
    """The outputs of ``mode`` ("one": a single split, x's dtype; ``exact``: y exactly N wide,
    else whole column blocks)."""
    col_blocks = pl.cdiv(n, block_n)
    wide = col_blocks * block_n
    row_block = pl.BlockSpec((rows, block_n), lambda c, s: (0, c))
    y = jax.ShapeDtypeStruct((rows, n if exact else wide), dtype)
    if mode == "one":
        return SplitOutputs(mode, (y,), (row_block,), ())
    if mode == "xla":
        shape = jax.ShapeDtypeStruct((splits, rows, wide), jnp.float32)
        spec = pl.BlockSpec((None, rows, block_n), lambda c, s: (s, 0, c))
        return SplitOutputs(mode, (shape,), (spec,), ())
    if mode == "atomic":
        acc = jax.ShapeDtypeStruct((rows, wide), jnp.float32)
        return SplitOutputs(mode, (acc,), (row_block,), ((jnp.zeros(acc.shape, acc.dtype), 0),))
    counts = jax.ShapeDtypeStruct((col_blocks,), jnp.int32)
    parts = jax.ShapeDtypeStruct((splits, rows, wide), jnp.float32)
    specs = (row_block, pl.BlockSpec((col_blocks,), lambda c, s: (0,)),
             pl.BlockSpec((splits, rows, block_n), lambda c, s: (0, 0, c)))
    return SplitOutputs(mode, (y, counts, parts), specs,
                        ((jnp.zeros(counts.shape, counts.dtype), 1),))
