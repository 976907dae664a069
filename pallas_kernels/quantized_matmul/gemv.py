"""4-bit weight GEMV in Pallas (Triton backend): a decode projection of 1-16 tokens.

At a few tokens the projection is bound by reading the packed weight (K N / 2 bytes), so each
int32 word is read once, unpacked in registers and multiplied by the activations with plain
FMAs (no tensor-core dot padded to 16 rows: at 1 token that is 15 rows of wasted work and a
register reshuffle per tile). The default inner loop (``denormal=True``, gemv_denormal.py) reads
each masked nibble as a float32 subnormal against x scaled by a power of two and takes the
zero point out of the loop: one LOP3 and one FFMA a weight (2.38-2.65 instructions a weight
in all with x pre-scaled by XLA, against 6.19 for the loop below, in the sm_90 SASS XLA
compiles for the Llama-3-8B projections: ``kernel_sass --compiler xla``; the FFMA is
gemv_denormal.fma's inline PTX, as XLA contracts no multiply-add).
The loop before it (``denormal=False``: the OR of each nibble with 2^23's bit pattern, then a
subtract) and the tensor-core dot are gemv_magic.py's.

    grid = (cdiv(N, block_n), splits)
    program (c, s): word rows [s K/8/splits, (s+1) K/8/splits), columns [c block_n, ..)
                    -> one split: [M, block_n] in x's dtype, the call's result (no XLA op
                       after it);
                       several: f32 partial [M, block_n] of split s, summed as
                       ``splits_sum`` says (gemv_splits.py): by XLA after the call (one
                       small fusion, deterministic; the default), by atomic adds, or by the
                       column block's last split in the kernel (deterministic)

Split-K gives the H200's 132 SMs enough programs at N = 4096 (32 column blocks of 128).
``dot=True`` swaps the FMAs for a tensor-core dot over rows padded to 16 (the same unpack):
the FMAs grow with the tokens, so :func:`gemv_config` takes the dot from 4 tokens.
:func:`int4_gemv` has the signature of :func:`~.reference.int4_matmul_reference`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .gemv_denormal import denormal_kernel, prescaled_inputs
from .gemv_magic import magic_kernel
from .gemv_splits import SPLITS_SUMS, auto_splits, split_outputs
from .reference import PER_WORD, is_pow2

DOT_ROWS = 16  # the smallest M and K Triton's dot takes


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow2_divisor(n: int) -> int:
    return n & -n


@dataclasses.dataclass(frozen=True)
class Int4GemvConfig:
    """Tunables of the GEMV kernel (static: each distinct config is one compile)."""

    block_n: int = 128  # output columns per program
    block_words: int = 16  # word rows (8 input rows each) per step; capped by the group
    num_splits: int | None = None  # split-K partitions; None: auto
    target_programs: int = 512  # auto: double the splits while the grid is smaller than this
    max_splits: int = 32
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False  # tensor-core dot over rows padded to 16 instead of FMAs
    # 2^23 loop (denormal=False): keep per-row partial sums [M', step rows, block_n] across
    # steps and reduce the rows once (no cross-warp reduction per step) while they fit in this
    # many f32 registers a thread; above it (more tokens), reduce every step into [M', block_n].
    max_acc_registers: int = 32
    evict_first: bool = False  # weights read once: ask the cache to drop them first
    # FMAs: read each masked nibble as a float32 subnormal (q 2^(p-149), exact) against x
    # scaled by 2^(149-p) (exact), and take the zero point out of the loop (one
    # s z sum_k x_k per step and column): one LOP3 and one FFMA a weight. False: the nibble
    # OR-ed into 2^23's bits, then a subtract of 2^23 + z, per weight.
    denormal: bool = True
    # Denormal path: nibbles 6, 7 of two word rows from one PRMT (inline PTX) instead of a
    # shift of each word.
    byte_permute: bool = True
    # Denormal path: load the next step's words while this step's are multiplied (carried in
    # registers: twice the words live; for programs of several steps and few warps).
    prefetch: bool = False
    # Split-K: how the splits' f32 partial sums are added (gemv_splits.py): "xla" (a fusion
    # after the call), "atomic" (atomic adds into zeros: not bit-for-bit reproducible; XLA
    # casts after the call) or "last" (the column block's last split sums them in the kernel
    # in split order; no XLA op after the call). The dot always takes "xla".
    splits_sum: str = "xla"
    # Denormal path: each program reads x as it is and scales and sums it itself (no XLA ops
    # before the call; one more integer op a thread per (token, row, nibble): in the sm_90
    # SASS, instructions a weight at 4 columns a thread 2.73 -> 3.06 (qkv, 1 token) and
    # 4.02 -> 4.65 (2 tokens), at 8 columns 2.40 -> 2.55 (gate_up)). False: XLA scales x
    # and sums each step's before the call (one small fusion) and the kernel loads them.
    # NOTE: False by default: on the H200 (2026-12-03, benchmarks/RESULTS.md) the Llama-3-8B
    # AWQ engine step at batch 1 took 9.2 ms with x in the kernel against 5.17 ms before it (the
    # host's launch 7.5 against 4.4 ms a step; device time 3.28 against 3.36 ms), two machines,
    # cause not found; the microbenchmark had it faster for 2 of 3 projections.
    x_in_kernel: bool = False
    # Denormal path: the products taken nibble by nibble across the step's word rows instead
    # of row by row, so that the step's words are all needed at once. In the sm_90 SASS
    # (Triton 3.6) ptxas then issues all of a step's weight loads together (qkv: 16 16-byte
    # loads a thread in one burst, 128 registers) where row by row it issues one or two just
    # ahead of their products (32 registers): each warp keeps ~8x the bytes in flight.
    # Timed in the engine's step on an H100: GEMV_TABLE's qkv, o and down take it, gate_up not.
    loads_first: bool = False
    # Denormal path: each program signals at its start that the next kernel may be launched
    # (``griddepcontrol.launch_dependents``), so that under XLA's programmatic dependent launch
    # (on by default in jax 0.11.2: every kernel waits for its predecessor's completion at its
    # start) the next kernel's programs are placed while this one runs instead of after it
    # ends. Without PDL the instruction does nothing. NOTE: False: on an H100 (2026-12-07,
    # benchmarks/RESULTS.md) it made each GEMV slower alone (o 8.5 -> 9.8 us, down 17.9 ->
    # 19.3) and the AWQ one-row step too (2.880 -> 2.995 ms back to back).
    trigger_dependents: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_words", "max_splits"):
            value = getattr(self, name)
            if not is_pow2(value):
                raise ValueError(f"{name}={value} must be a power of two")
        if self.dot and self.block_words < DOT_ROWS:
            raise ValueError(f"block_words={self.block_words} must be >= {DOT_ROWS} with dot")
        if self.num_splits is not None and not is_pow2(self.num_splits):
            raise ValueError(f"num_splits={self.num_splits} must be a power of two or None")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two <= 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")
        if self.splits_sum not in SPLITS_SUMS:
            raise ValueError(f"splits_sum={self.splits_sum!r} must be one of {SPLITS_SUMS}")

    def reduce_every_step(self, rows: int, step_words: int) -> bool:
        threads = 32 * self.num_warps
        return not self.dot and rows * step_words * self.block_n > self.max_acc_registers * threads

    def step_words(self, k: int, group_size: int) -> int:
        """Word rows per step: a power of two that divides the group (a step never crosses
        a group), at most ``block_words``."""
        return min(self.block_words, _pow2_divisor(group_size // PER_WORD))

    def splits(self, k: int, n: int, group_size: int) -> int:
        if self.num_splits is not None:
            return self.num_splits
        return auto_splits(k // PER_WORD // self.step_words(k, group_size),
                           pl.cdiv(n, self.block_n), self.max_splits, self.target_programs)


# Configs by (tokens rounded up to a power of two, K, N); a shape not listed takes
# gemv_config's rule. The denormal inner loop everywhere: a thread owns block_n / (32 num_warps)
# columns and loads x once per (row, nibble) for all of them, so at least 4 columns a thread.
# Timed in the engine's AWQ batch-1 step on an H100 (2026-12-06, benchmarks/RESULTS.md: each
# projection's device time by position in a traced step, step_profile --sequence), median us a
# layer, GEMV_TABLE before -> this table, both with the FMA: qkv 10.5 -> 8.4 and o 9.0 -> 6.1
# (each step's 16 word loads issued together, loads_first), down 20.8 -> 16.0 (the denormal
# loop with the next step's words prefetched, instead of the 2^23 loop's 6.19 instructions a
# weight and a shared-memory reduction every step); gate_up stays (26.9 us; with loads_first
# 29.5: 168 registers). The GEMVs 2.15 -> 1.84 ms a step. Instructions a weight in XLA's
# compile (kernel_sass --kernel gemv --compiler xla), whole kernel when a program runs one step,
# else its loop:
GEMV_TABLE: dict[tuple[int, int, int], Int4GemvConfig] = {
    # qkv: 2.54, 96 registers, 14 of its 16 weight loads before the first product
    (1, 4096, 6144): Int4GemvConfig(block_n=256, num_warps=2, loads_first=True),
    # o: 2.54 (as qkv)
    (1, 4096, 4096): Int4GemvConfig(block_n=256, num_warps=2, loads_first=True),
    # gate_up: 2.38, 64 registers
    (1, 4096, 28672): Int4GemvConfig(block_n=512, num_warps=2),
    # down: 2.65, 70 registers, 8 loads issued together and 8 prefetched
    (1, 14336, 4096): Int4GemvConfig(block_n=256, num_warps=2, block_words=8, prefetch=True,
                                      loads_first=True),
}
# From 4 tokens the dot variant: counted in the SASS of the kernel compiled for sm_90 (Triton
# 3.6, K = N = 4096, group 128; not a timing), instructions per weight of the denormal FMA loop
# (block_n=256, num_warps=2) are ~2.8 at 1 token, ~3.9 at 2, ~6.5 at 3-4 and ~11.6 at 8,
# against ~6.6 for the dot at any count (its padded rows cost nothing extra). (The 2^23-magic
# loop it replaced: ~6, ~9, ~15, ~28.)
DOT_FROM_TOKENS = 4


def gemv_config(m: int, k: int, n: int, group_size: int) -> Int4GemvConfig:
    """The config :func:`int4_gemv` uses for ``m`` tokens over a [K, N] weight."""
    rows = _next_pow2(m)
    if (rows, k, n) in GEMV_TABLE:
        return GEMV_TABLE[rows, k, n]
    dot = rows >= DOT_FROM_TOKENS and _pow2_divisor(group_size // PER_WORD) >= DOT_ROWS
    if dot:
        return Int4GemvConfig(dot=True)
    # The denormal loop: 4 columns a thread (see GEMV_TABLE).
    return Int4GemvConfig(block_n=256, num_warps=2, block_words=16 if rows <= 2 else 32 // rows)


def gemv_unsupported(m: int, k: int, n: int, group_size: int,
                     config: Int4GemvConfig | None = None) -> str | None:
    """Why the GEMV kernel cannot take this shape (None: it can)."""
    config = config or gemv_config(m, k, n, group_size)
    if m < 1:
        return "no tokens"
    if k % PER_WORD or group_size % PER_WORD or k % group_size:
        return f"group_size={group_size} must be a multiple of {PER_WORD} dividing K={k}"
    step = config.step_words(k, group_size)
    if config.dot and step < DOT_ROWS:
        return f"dot needs steps of >= {DOT_ROWS} word rows; group_size={group_size} gives {step}"
    splits = config.splits(k, n, group_size)
    if (k // PER_WORD) % (step * splits):
        return f"K/8={k // PER_WORD} is not a multiple of {step} word rows x {splits} splits"
    return None


def _checked_config(m: int, k: int, words: int, n: int, group_size: int,
                    config: Int4GemvConfig | None) -> Int4GemvConfig:
    config = config or gemv_config(m, k, n, group_size)
    reason = gemv_unsupported(m, k, n, group_size, config)
    if reason is not None or words * PER_WORD != k:
        raise ValueError(reason or f"x has K={k}, qweight {words * PER_WORD} rows")
    return config


def prescale_layout(config: Int4GemvConfig, k: int, group_size: int) -> tuple[int, bool] | None:
    """(word rows a step, pairs) of the pre-scaled x the config's kernel reads
    (:func:`~.gemv_denormal.prescaled_inputs`), or None where it reads x as it is (the dot,
    the 2^23 loop, ``x_in_kernel``)."""
    if config.dot or not config.denormal or config.x_in_kernel:
        return None
    step_words = config.step_words(k, group_size)
    return step_words, config.byte_permute and step_words % 2 == 0


@functools.partial(jax.jit, static_argnames=("group_size", "interpret", "config"))
def int4_gemv(
    x: jax.Array,  # [.., K]
    qweight: jax.Array,  # i32[K/8, N]
    scales: jax.Array,  # [G, N]
    zeros: jax.Array,  # u8[G, N]
    *,
    group_size: int,
    interpret: bool = False,
    config: Int4GemvConfig | None = None,
) -> jax.Array:  # [.., N] in x's dtype
    """Same contract as :func:`int4_matmul_reference`; raises ValueError for a shape
    :func:`gemv_unsupported` names."""
    *lead, k = x.shape
    words, n = qweight.shape
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    config = _checked_config(m, k, words, n, group_size, config)
    # x is read whole by every program: [M, K/8, 8] as it is (a bitcast); the dot pads it to
    # the rows its tile loads take (a power of two, >= 16)
    rows = max(DOT_ROWS, _next_pow2(m)) if config.dot else m
    xp = jnp.pad(x2, ((0, rows - m), (0, 0))) if rows > m else x2
    xp = xp.reshape(rows, words, PER_WORD)  # [M', K/8, 8]
    step_words = config.step_words(k, group_size)
    if config.dot or not config.denormal:
        reduce = config.reduce_every_step(_next_pow2(rows), step_words)
        kernel = functools.partial(magic_kernel, dot=config.dot, dtype=x.dtype, reduce=reduce)
        x_in = [xp]
    else:  # x scaled per nibble position (exact powers of two) and summed per step
        pairs = config.byte_permute and step_words % 2 == 0
        kernel = _denormal(config, pairs, prescaled=not config.x_in_kernel)
        x_in = [xp] if config.x_in_kernel else prescaled_inputs(xp, step_words, pairs, interpret)
    y = _launch(kernel, x_in, qweight, scales, zeros, rows=rows, m=m, dtype=x.dtype,
                group_size=group_size, config=config, interpret=interpret)
    return y.reshape(*lead, n)


@functools.partial(jax.jit,
                   static_argnames=("dtype", "pairs", "group_size", "interpret", "config",
                                    "partials"))
def int4_gemv_prescaled(
    xs: jax.Array,  # f32[M, K/8, 8]: x scaled per nibble position (prescaled_inputs)
    xsum: jax.Array,  # f32[M, K/8/step_words]: each step's x sum times 2^-X_EXP
    qweight: jax.Array,  # i32[K/8, N]
    scales: jax.Array,  # [G, N]
    zeros: jax.Array,  # u8[G, N]
    *,
    dtype,  # x's dtype: the result's
    pairs: bool,
    group_size: int,
    interpret: bool = False,
    config: Int4GemvConfig | None = None,
    partials: bool = False,
) -> jax.Array:  # [M, N] in dtype; with partials f32[splits, M, N]
    """:func:`int4_gemv` of the x whose pre-scaled inputs ``(xs, xsum)`` another kernel wrote
    (gemv_prescale.rmsnorm_prescale: the RMSNorm before the projection); a ValueError where
    the config's kernel reads another layout (:func:`prescale_layout`). ``partials``: the
    splits' float32 sums unsummed, for a kernel after the call to add (where
    :func:`xla_summed_splits` counts them; a ValueError elsewhere)."""
    m, words, _ = xs.shape
    k, n = words * PER_WORD, qweight.shape[1]
    config = _checked_config(m, k, words, n, group_size, config)
    layout = prescale_layout(config, k, group_size)
    given = (words // xsum.shape[1], pairs)
    if layout != given or xsum.shape != (m, words // layout[0]):
        raise ValueError(f"pre-scaled x in steps of {given[0]} word rows (pairs={pairs}), "
                         f"xsum {xsum.shape}: the GEMV's config {config} reads {layout}")
    return _launch(_denormal(config, pairs, prescaled=True), [xs, xsum], qweight, scales,
                   zeros, rows=m, m=m, dtype=dtype, group_size=group_size, config=config,
                   interpret=interpret, partials=partials)


def xla_summed_splits(config: Int4GemvConfig, k: int, n: int, group_size: int) -> int:
    """How many float32 partials the config's call leaves for XLA to sum (splits_sum "xla",
    or the dot, over several splits) at exactly N columns (whole column blocks); 0 where the
    kernel writes the result itself (one split, "last") or adds it ("atomic")."""
    splits = config.splits(k, n, group_size)
    mode = _splits_mode(config, splits)
    return splits if mode == "xla" and n % config.block_n == 0 else 0


def _splits_mode(config: Int4GemvConfig, splits: int) -> str:
    """How the call's splits become its result: "one" split stores it, else the dot's
    partials are summed by XLA, else as ``config.splits_sum`` says (gemv_splits.py)."""
    return "one" if splits == 1 else "xla" if config.dot else config.splits_sum


def _denormal(config: Int4GemvConfig, pairs: bool, prescaled: bool):
    return functools.partial(denormal_kernel, pairs=pairs, prefetch=config.prefetch,
                             loads_first=config.loads_first, prescaled=prescaled,
                             trigger_dependents=config.trigger_dependents)


def _launch(kernel, x_in: list, qweight, scales, zeros, *, rows: int, m: int, dtype,
            group_size: int, config: Int4GemvConfig, interpret: bool,
            partials: bool = False) -> jax.Array:  # [M, N] in dtype
    """The GEMV's pallas_call over ``x_in`` (whole arrays, read by every program) and the
    weight's column blocks and splits, and its result (gemv_splits.split_outputs); with
    ``partials``, the f32 [splits, M, N] XLA would sum."""
    words, n = qweight.shape
    k = words * PER_WORD
    if partials and not xla_summed_splits(config, k, n, group_size):
        raise ValueError(f"the config {config} leaves no split partials at [K={k}, N={n}]")
    step_words = config.step_words(k, group_size)
    splits = config.splits(k, n, group_size)
    split_words = words // splits
    col_blocks = pl.cdiv(n, config.block_n)
    groups = scales.shape[0]
    # One split stores x's dtype into y [M, N] (masked past N; the dot: its padded tile);
    # several add their partials as splits_sum says (gemv_splits.py).
    mode = _splits_mode(config, splits)
    exact = mode in ("one", "last") and not config.dot
    outs = split_outputs(mode, splits=splits, rows=rows, n=n, block_n=config.block_n,
                         dtype=dtype, exact=exact)
    kernel = functools.partial(
        kernel, n=n, steps=split_words // step_words, step_words=step_words,
        group_words=group_size // PER_WORD, evict_first=config.evict_first,
        out_n=n if exact and n % config.block_n else None, mode=mode, interpret=interpret)
    in_specs = [
        *[pl.BlockSpec(a.shape, lambda c, s, d=a.ndim: (0,) * d) for a in x_in],
        pl.BlockSpec((split_words, config.block_n), lambda c, s: (s, c)),
        pl.BlockSpec((groups, config.block_n), lambda c, s: (0, c)),
        pl.BlockSpec((groups, config.block_n), lambda c, s: (0, c)),
    ]
    n_x = len(x_in)
    result = outs.pallas_call(
        lambda *refs: kernel(refs[:n_x], *refs[n_x:n_x + 3], refs[n_x + 3:]),
        [*x_in, qweight, scales, zeros], in_specs,
        grid=(col_blocks, splits),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                                num_stages=config.num_stages),
        interpret=interpret,
        name="int4_gemv",
    )
    if partials:
        return result[0][:, :m]
    return outs.result(result, m, n, dtype)

