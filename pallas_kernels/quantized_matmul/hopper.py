"""4-bit weight matmul for Hopper in Pallas' Mosaic GPU backend: wgmma with the weight as its
register operand, upcast and dequantized in registers, for the AWQ engine's mid-size steps.

Tested on the H200 against the reference (tests/test_int4_hopper.py's GPU tests) and timed at
Llama-3-8B's gate_up (benchmarks/RESULTS.md, 2026-12-05: 65.8 us at 128 tokens against 209.7
for XLA's dequantize + dot and 91.5 for bf16; at 1-16 tokens slower than the GEMV). The engine
runs it over an N-major copy of the weights made at load (``jaxllm.layers.linear.Int4WeightNK``)
under ``JAXLLM_INT4_HOPPER`` "on", "both", or the default "auto" where that resolves to "both"
(on an H100, 2026-12-07: the AWQ engine's offline run 1.16x the packed words' alone).
The Triton kernels cannot do this: in their sm_90 SASS the unpacked weight reaches wgmma
through shared memory one bf16 at a time (benchmarks/RESULTS.md, 2026-12-05).

The product is computed transposed, y^T [N, M] = W^T [N, K] x^T [K, M], so that the weight is
wgmma's A operand, which may live in registers: each compute warpgroup loads its [64, tile_k]
rows of the weight as XLA's int4 type (:func:`hopper_weight`: the packed words [K/8, N] as
int4 [N, K], K contiguous, nibbles centred on 8), upcasts them to bf16 (Mosaic GPU's
mixed-input layouts), and dequantizes them with its rows' zero points and scales of the step's
group, ``(q' - z') s`` with ``q' = q - 8`` and ``z' = z - 8``: integers exact in bf16, one
rounding of the product, as the reference rounds. B is x^T: x's [tile_tokens, tile_k] tile
in shared memory, read K-major (no transpose of x). A memory warpgroup copies the steps'
tiles by TMA (``emit_pipeline_warp_specialized``); the programs stay resident and take output
tiles in turn::

    items: (N / 128) x (M' / tile_tokens) tiles x S splits of K, M' the tokens padded to
           tile_tokens, S doubled while the tiles alone leave programs idle (decode)
    program p: items p, p + P, ...; per item, K / S / tile_k steps, each
        wg 0, 1   rows [64 w, 64 (w + 1)) of the tile: A = the dequantized weight,
                  acc += A @ x^T tile (wgmma; JAX's GPU interpreter: a register dot)
        wg 2      TMA: weight [128, tile_k] int4, x [tile_tokens, tile_k], the group's
                  scales and zero points [1, 128]

:func:`int4_matmul_hopper` has the signature of :func:`~.reference.int4_matmul_reference` (it
converts the weight on each call: for tests and the benchmark's comparison);
:func:`int4_matmul_hopper_nk` takes the converted weight (what the engine stores).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .reference import PER_WORD
from .xla_int4 import CENTRE, centred_nibbles

WGMMA_ROWS = 64  # a warpgroup's wgmma rows


@dataclasses.dataclass(frozen=True)
class HopperInt4Config:
    """Tunables (static)."""

    tile_tokens: int = 128  # tokens per tile: wgmma's N (a multiple of 16; at most 256)
    tile_k: int = 128  # K per pipeline step: divides the group size
    max_concurrent_steps: int = 4  # pipeline stages in shared memory
    num_programs: int | None = None  # resident programs; None: the device's SMs (2 interpreted)
    # Split-K: K partitions of whole groups, each summed in float32 by XLA after the call;
    # None: doubled while the tiles do not fill the programs (decode: N / 128 tiles)
    num_splits: int | None = None
    max_splits: int = 16

    def __post_init__(self):
        if self.tile_tokens % 16 or not 16 <= self.tile_tokens <= 256:
            raise ValueError(f"tile_tokens={self.tile_tokens} must be a multiple of 16 in "
                             "[16, 256]")
        if self.tile_k % 64:
            raise ValueError(f"tile_k={self.tile_k} must be a multiple of 64")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 2")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits} must be >= 1 or None")

    def splits(self, tiles: int, k: int, group_size: int, programs: int) -> int:
        """Split-K count: fixed, or doubled while every split keeps whole groups and the
        tiles times the splits stay short of the programs."""
        if self.num_splits is not None:
            return self.num_splits
        splits = 1
        while (splits * 2 <= self.max_splits and k % (2 * splits * group_size) == 0
               and tiles * splits < programs):
            splits *= 2
        return splits


# Pipeline stages for the 16-token tile (1-16 tokens): its steps are short (8 KB of weight
# a program), so more of them in flight. On the H200 (i5, RESULTS.md 2026-12-05) gate_up's
# 16-token tile took 59.8 / 54.8 us at 8 stages against 66.8 / 97.5 at 4 (1 / 16 tokens);
# 6 or 8 stages of the 128-token tile exceed the shared memory.
SMALL_TILE_STAGES = 8


def config_for(m: int) -> HopperInt4Config:
    """The config for ``m`` tokens: one tile of tokens up to 128 (the smallest multiple of 16
    that holds them: few tokens make a narrow wgmma, not a padded one), then tiles of 128."""
    tile_tokens = min(128, max(16, -(-m // 16) * 16))
    if tile_tokens == 16:
        return HopperInt4Config(tile_tokens=16, max_concurrent_steps=SMALL_TILE_STAGES)
    return HopperInt4Config(tile_tokens=tile_tokens)


def unsupported(m: int, k: int, n: int, group_size: int,
                config: HopperInt4Config | None = None) -> str | None:
    """Why the kernel cannot take this shape (None: it can)."""
    config = config or HopperInt4Config()
    if group_size % config.tile_k or k % group_size:
        return (f"group_size={group_size} must be a multiple of tile_k={config.tile_k} "
                f"dividing K={k}")
    if n % (2 * WGMMA_ROWS):
        return f"N={n} is not a multiple of {2 * WGMMA_ROWS}"
    if config.num_splits is not None and k % (config.num_splits * group_size):
        return f"K={k} is not {config.num_splits} splits of whole groups of {group_size}"
    if m < 1:
        return "no tokens"
    return None


def hopper_weight(qweight: jax.Array) -> jax.Array:
    """The packed words i32[K/8, N] (row 8r + j in bits 4j..4j+3) as int4 [N, K]: q - 8, K
    contiguous (XLA's int4 type; the layout the kernel's A operand is read in)."""
    return centred_nibbles(qweight).T


def centred_zeros_of(zeros: jax.Array, dtype) -> jax.Array:
    """The zero points u8[G, N] as ``z - 8`` in ``dtype`` (exact: small integers), as the
    kernel applies them to the centred nibbles."""
    return (zeros.astype(jnp.int32) - CENTRE).astype(dtype)


def n_major_operands(x: jax.Array, weight: jax.Array, group_size: int, config, pick,
                     why_unsupported):
    """A kernel over the N-major weight int4 [N, K]: (x's leading dims, x as [M, K], the
    config: ``config`` or ``pick(M)``); ValueError with ``why_unsupported(M, K, N, group,
    config)``'s reason, or for x's K not the weight's."""
    *lead, k = x.shape
    n, k_w = weight.shape
    x2 = x.reshape(-1, k)  # [M, K]
    config = config or pick(x2.shape[0])
    reason = why_unsupported(x2.shape[0], k, n, group_size, config)
    if reason is not None or k_w != k:
        raise ValueError(reason or f"x has K={k}, the weight {k_w}")
    return lead, x2, config


def _swizzled(minor_bits: int, elem_bits: int, what: str):
    swizzle = plgpu.find_swizzle(minor_bits, what)
    return (plgpu.TilingTransform((8, swizzle * 8 // elem_bits)), plgpu.SwizzleTransform(swizzle))


# jitted: an unrolled forward calls it 4 times a layer over 4 shapes, and each call's Mosaic
# GPU lowering (~0.4 s on the CPU machine) then runs once a shape, not once a call site (the
# Llama-3-8B AWQ step of 128 tokens lowered in 33 s, 128 kernels; RESULTS.md 2026-12-07)
@functools.partial(jax.jit, static_argnames=("group_size", "interpret", "config",
                                             "centred_zeros"))
def int4_matmul_hopper_nk(
    x: jax.Array,  # [.., K]
    weight: jax.Array,  # int4[N, K] (hopper_weight)
    scales: jax.Array,  # [G, N]
    zeros: jax.Array,  # u8[G, N]
    *,
    group_size: int,
    interpret: bool = False,
    config: HopperInt4Config | None = None,
    centred_zeros: bool = False,
) -> jax.Array:  # [.., N] in x's dtype
    """``x @ W`` with W[k, n] = (q[k, n] - zeros[k // g, n]) scales[k // g, n], the weight as
    :func:`hopper_weight` gives it; raises ValueError for a shape :func:`unsupported`
    names. ``config`` None: :func:`config_for` the tokens. ``centred_zeros``: ``zeros`` are
    already ``z - 8`` in x's dtype and ``scales`` in x's dtype (stored so: no conversion a
    call)."""
    lead, x2, config = n_major_operands(x, weight, group_size, config, config_for, unsupported)
    m, k = x2.shape
    n = weight.shape[0]
    dtype = x.dtype
    tile_tokens, tile_k = config.tile_tokens, config.tile_k
    m_pad = pl.cdiv(m, tile_tokens) * tile_tokens
    xp = jnp.pad(x2, ((0, m_pad - m), (0, 0)))  # [M', K]
    s = scales.astype(dtype)  # [G, N]
    z = zeros.astype(dtype) if centred_zeros else centred_zeros_of(zeros, dtype)  # [G, N]
    rows = 2 * WGMMA_ROWS  # a program's tile of the weight's rows
    row_tiles, token_tiles = n // rows, m_pad // tile_tokens
    num_programs = config.num_programs or (2 if interpret else _num_sms())
    splits = config.splits(row_tiles * token_tiles, k, group_size, num_programs)
    k_split = k // splits
    steps, groups = k_split // tile_k, k_split // group_size  # a split's
    items = row_tiles * token_tiles * splits
    num_programs = min(num_programs, items)
    out_dtype = dtype if splits == 1 else jnp.float32  # partial sums: summed after the call
    w_transforms = _swizzled(tile_k * 4, 4, "the weight")
    x_transforms = _swizzled(tile_k * 16, 16, "x")
    out_transforms = _swizzled(tile_tokens * jnp.dtype(out_dtype).itemsize * 8,
                               jnp.dtype(out_dtype).itemsize * 8, "the output")

    def kernel(w_gmem, x_gmem, s_gmem, z_gmem, out_gmem, out_smem):
        wg = lax.axis_index("wg")
        wg_rows = pl.ds(wg * WGMMA_ROWS, WGMMA_ROWS)

        def pipeline(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
                max_concurrent_steps=config.max_concurrent_steps, compute_context=context,
                in_specs=[
                    plgpu.BlockSpec((rows, tile_k), lambda i: (0, i), transforms=w_transforms),
                    plgpu.BlockSpec((tile_tokens, tile_k), lambda i: (0, i),
                                    transforms=x_transforms),
                    plgpu.BlockSpec((1, rows), lambda i: (i * tile_k // group_size, 0)),
                    plgpu.BlockSpec((1, rows), lambda i: (i * tile_k // group_size, 0)),
                ])

        def step(_, w_smem, x_smem, s_smem, z_smem, acc):
            q = w_smem[wg_rows].astype(dtype)  # [64, tile_k]: upcast in registers
            scale = lax.broadcast_in_dim(s_smem[0, wg_rows], q.shape, [0])
            zero = lax.broadcast_in_dim(z_smem[0, wg_rows], q.shape, [0])
            a = (q - zero) * scale
            if interpret:  # JAX's GPU interpreter has no wgmma: the product in registers
                return acc + jnp.dot(a, x_smem[...].T, preferred_element_type=jnp.float32)
            plgpu.wgmma(acc, a, x_smem.transpose((1, 0)))  # B = x^T: x's tile read K-major
            plgpu.wgmma_wait(0)
            return acc

        ignore = lambda *_, **__: None

        @functools.partial(pl.run_scoped, allocations=pipeline(ignore, ignore).get_allocations(
            w_gmem, x_gmem, s_gmem, z_gmem), collective_axes="wg")
        def _(allocations):
            @plgpu.nd_loop((items,), collective_axes="programs")
            def _(loop):
                (item,) = loop.index
                tile, split = lax.div(item, splits), lax.rem(item, splits)
                row_tile, token_tile = lax.div(tile, token_tiles), lax.rem(tile, token_tiles)
                tile_rows = pl.ds(row_tile * rows, rows)
                tile_cols = pl.ds(token_tile * tile_tokens, tile_tokens)
                k_cols = pl.ds(split * k_split, k_split)
                k_groups = pl.ds(split * groups, groups)

                def context(run):
                    if interpret:
                        acc = run(jnp.zeros((WGMMA_ROWS, tile_tokens), jnp.float32))
                    else:
                        def in_acc(acc_ref):
                            run(acc_ref)
                            return acc_ref[...]

                        acc = pl.run_scoped(
                            in_acc, plgpu.ACC((WGMMA_ROWS, tile_tokens), jnp.float32))
                    # The previous tile's store has read the buffer before it is refilled.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    out_smem[wg] = acc.astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[wg], out_gmem.at[split, tile_rows, tile_cols].at[wg_rows])

                pipeline(step, context)(
                    w_gmem.at[tile_rows, k_cols], x_gmem.at[tile_cols, k_cols],
                    s_gmem.at[k_groups, tile_rows], z_gmem.at[k_groups, tile_rows],
                    allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_t = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, n, m_pad), out_dtype),
        grid=(num_programs,),
        grid_names=("programs",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types={"out_smem": plgpu.SMEM((2, WGMMA_ROWS, tile_tokens), out_dtype,
                                              transforms=out_transforms)},
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
    )(weight, xp, s, z)  # [splits, N, M']
    out_t = out_t[0] if splits == 1 else out_t.sum(axis=0).astype(dtype)
    return out_t[:, :m].T.reshape(*lead, n)


def _num_sms() -> int:
    # (a device that does not say, e.g. the CPU's while tracing for a GPU: the H200's 132)
    return getattr(jax.devices()[0], "core_count", None) or 132


def int4_matmul_hopper(
    x: jax.Array,  # [.., K]
    qweight: jax.Array,  # i32[K/8, N]
    scales: jax.Array,  # [G, N]
    zeros: jax.Array,  # u8[G, N]
    *,
    group_size: int,
    interpret: bool = False,
    config: HopperInt4Config | None = None,
) -> jax.Array:  # [.., N] in x's dtype
    """Same contract as :func:`int4_matmul_reference`; the weight converted
    (:func:`hopper_weight`) on every call."""
    k = qweight.shape[-2] * PER_WORD
    if qweight.ndim != 2 or k != x.shape[-1]:
        raise ValueError(f"x has K={x.shape[-1]}, qweight {k} rows (a 2-D weight)")
    return int4_matmul_hopper_nk(x, hopper_weight(qweight), scales, zeros,
                                 group_size=group_size, interpret=interpret, config=config)
