"""4-bit weight x activation matmul in Pallas (Triton backend), for few tokens (decode).

The weight stays packed in HBM (a quarter of bf16's bytes) and is dequantized in registers,
tile by tile; decode is bound by reading the weight, so reading a quarter of it is the point.
To dot a whole tile without reordering the unpacked values in registers, the activations are
permuted instead (once, in XLA; they are tiny): nibble j of word row r is input row 8r + j,
so with ``xp[j, m, r] = x[m, 8r + j]``::

    y[m, n] = sum_j  xp[j, m, :] @ W_j[:, n]        W_j[r, n] = (nibble j of qweight[r, n]
                                                                - zeros[g(r), n]) * scales[g(r), n]
    grid = (N / block_n, splits, M / block_m)
    program (n, s, m): word rows [s K/8/splits, (s+1) K/8/splits) in steps of block_k / 8
                       -> f32 partial [block_m, block_n] of split s (summed in XLA)

Split-K keeps the grid large enough to fill the GPU when N / block_n alone would not (a
4096-wide output in tiles of 128 is 32 programs for 132 SMs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .reference import PER_WORD, is_pow2

MIN_DOT = 16  # the smallest tile side Triton's dot takes



def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Int4MatmulConfig:
    """Tunables of the kernel (static)."""

    block_n: int = 128  # output columns per program
    block_k: int = 128  # input rows per step (block_k / 8 word rows; >= 16 for the dot)
    block_m: int = 64  # most token rows per program (fewer tokens: padded to a power of 2 >= 16)
    num_splits: int | None = None  # split-K partitions; None: auto
    target_programs: int = 512  # auto: split until the grid has this many programs
    max_splits: int = 16
    num_warps: int = 4
    num_stages: int = 3
    # One dot of K = block_k a step over the tile unpacked in K order (x read as it is) instead
    # of 8 dots of K = block_k / 8 over nibble planes (x permuted in XLA). NOTE: off until
    # timed on a GPU; compiled for sm_90 on a CPU (benchmarks/RESULTS.md, 2026-12-03) its step
    # loop is 980 instructions a warp against 1,563, without the 71 spills and with 64 FADDs
    # against 512 (the 8 partial products' sums).
    one_dot: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_m"):
            value = getattr(self, name)
            if value < MIN_DOT or not is_pow2(value):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT}")
        if self.block_k < MIN_DOT * PER_WORD or not is_pow2(self.block_k):
            raise ValueError(f"block_k={self.block_k} must be a power of two >= "
                             f"{MIN_DOT * PER_WORD} (block_k / 8 word rows feed the dot)")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits} must be >= 1 or None")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two <= 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")

    def splits(self, k: int, n: int, m_blocks: int) -> int:
        """Split-K count: fixed, or doubled while it still divides K into whole steps and the
        grid is short of ``target_programs``."""
        steps = k // self.block_k
        if self.num_splits is not None:
            return self.num_splits
        splits = 1
        while (splits * 2 <= self.max_splits and steps % (splits * 2) == 0
               and (n // self.block_n) * m_blocks * splits < self.target_programs):
            splits *= 2
        return splits


def unsupported(m: int, k: int, n: int, group_size: int,
                config: Int4MatmulConfig | None = None) -> str | None:
    """Why the kernel cannot take this shape (None: it can). Callers fall back to the
    reference."""
    config = config or Int4MatmulConfig()
    if group_size % PER_WORD or k % group_size:
        return f"group_size={group_size} must be a multiple of {PER_WORD} dividing K={k}"
    if n % config.block_n:
        return f"N={n} is not a multiple of block_n={config.block_n}"
    splits = config.splits(k, n, 1)
    if k % (config.block_k * splits):
        return f"K={k} is not a multiple of block_k={config.block_k} x {splits} splits"
    if m < 1:
        return "no tokens"
    return None


def _step_tile(w_ref, s_ref, z_ref, i, split, *, steps: int, block_words: int,
               group_words: int, dtype):
    """Step ``i``'s packed words and their groups' scales (in ``dtype``) and zeros (i32):
    (first word row within the split, i32[block_k / 8, block_n], [1 or block_k / 8, block_n]
    twice). ``split``: the program's K split (read outside the step loop, where the Pallas
    interpreter can lower it)."""
    r0 = pl.multiple_of(i * block_words, block_words)  # word row within the split
    words = w_ref[pl.ds(r0, block_words), :]  # i32[block_k / 8, block_n]
    first = split * steps * block_words + r0  # word row within K
    if group_words % block_words == 0:  # the whole step in one group: one row of each
        scales = s_ref[first // group_words, :][None, :]  # [1, block_n]
        zeros = z_ref[first // group_words, :][None, :]
    else:  # smaller groups: each word row's own group
        groups = (first + jnp.arange(block_words, dtype=jnp.int32)) // group_words
        scales, zeros = s_ref[groups, :], z_ref[groups, :]  # [block_k / 8, block_n]
    return r0, words, scales.astype(dtype), zeros.astype(jnp.int32)


def _kernel(x_ref, w_ref, s_ref, z_ref, o_ref, *, steps: int, block_words: int,
            group_words: int, dtype):
    split = pl.program_id(1)
    block_m, block_n = o_ref.shape

    def step(i, acc):
        r0, words, scales, zeros = _step_tile(w_ref, s_ref, z_ref, i, split, steps=steps,
                                              block_words=block_words,
                                              group_words=group_words, dtype=dtype)
        for j in range(PER_WORD):
            # Arithmetic shift drags a negative word's sign bits in; the mask drops them.
            q = jnp.right_shift(words, 4 * j) & 0xF
            w = (q - zeros).astype(dtype) * scales  # as the reference rounds it
            xj = x_ref[j, :, pl.ds(r0, block_words)]  # [block_m, block_k / 8]
            acc += jnp.dot(xj, w, preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[...] = acc


def _kernel_one_dot(x_ref, w_ref, s_ref, z_ref, o_ref, *, steps: int, block_words: int,
                    group_words: int, dtype):
    split = pl.program_id(1)
    block_m, block_n = o_ref.shape
    block_k = block_words * PER_WORD
    shifts = 4 * jax.lax.broadcasted_iota(jnp.int32, (block_words, PER_WORD, block_n), 1)

    def step(i, acc):
        r0, words, scales, zeros = _step_tile(w_ref, s_ref, z_ref, i, split, steps=steps,
                                              block_words=block_words,
                                              group_words=group_words, dtype=dtype)
        # Nibble j of word row r is input row 8 r + j, so [rows, 8, cols] flattens in K order.
        q = jnp.right_shift(words[:, None, :], shifts) & 0xF
        w = (q - zeros[:, None, :]).astype(dtype) * scales[:, None, :]
        xk = x_ref[:, pl.ds(pl.multiple_of(r0 * PER_WORD, block_k), block_k)]
        return acc + jnp.dot(xk, w.reshape(block_k, block_n),  # [block_m, block_k] @ [.., n]
                             preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("group_size", "interpret", "config"))
def int4_matmul(
    x: jax.Array,  # [.., K]
    qweight: jax.Array,  # i32[K/8, N]
    scales: jax.Array,  # [G, N]
    zeros: jax.Array,  # u8[G, N]
    *,
    group_size: int,
    interpret: bool = False,
    config: Int4MatmulConfig | None = None,
) -> jax.Array:  # [.., N] in x's dtype
    """Same contract as :func:`int4_matmul_reference`; raises ValueError for a shape
    :func:`unsupported` names."""
    config = config or Int4MatmulConfig()
    *lead, k = x.shape
    words, n = qweight.shape
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    reason = unsupported(m, k, n, group_size, config)
    if reason is not None or words * PER_WORD != k:
        raise ValueError(reason or f"x has K={k}, qweight {words * PER_WORD} rows")
    block_m = min(config.block_m, max(MIN_DOT, _next_pow2(m)))
    m_pad = pl.cdiv(m, block_m) * block_m
    splits = config.splits(k, n, m_pad // block_m)
    split_words = words // splits
    block_words = config.block_k // PER_WORD
    xp = jnp.pad(x2, ((0, m_pad - m), (0, 0)))
    if config.one_dot:  # [M', K] as it is
        x_spec = pl.BlockSpec((block_m, split_words * PER_WORD), lambda j, s, i: (i, s))
    else:  # [8, M', K/8]: nibble planes
        xp = xp.reshape(m_pad, words, PER_WORD).transpose(2, 0, 1)
        x_spec = pl.BlockSpec((PER_WORD, block_m, split_words), lambda j, s, i: (0, i, s))
    groups = scales.shape[0]
    kernel = functools.partial(_kernel_one_dot if config.one_dot else _kernel,
                               steps=split_words // block_words, block_words=block_words,
                               group_words=group_size // PER_WORD, dtype=x.dtype)
    partial = pl.pallas_call(
        kernel,
        grid=(n // config.block_n, splits, m_pad // block_m),
        in_specs=[
            x_spec,
            pl.BlockSpec((split_words, config.block_n), lambda j, s, i: (s, j)),
            pl.BlockSpec((groups, config.block_n), lambda j, s, i: (0, j)),
            pl.BlockSpec((groups, config.block_n), lambda j, s, i: (0, j)),
        ],
        out_specs=pl.BlockSpec((None, block_m, config.block_n), lambda j, s, i: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, m_pad, n), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                                num_stages=config.num_stages),
        interpret=interpret,
        name="int4_matmul",
    )(xp, qweight, scales, zeros)
    y = partial.sum(axis=0) if splits > 1 else partial[0]  # [M', N] f32
    return y[:m].astype(x.dtype).reshape(*lead, n)
