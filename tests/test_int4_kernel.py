"""The 4-bit matmul and GEMV kernels (pallas_kernels/quantized_matmul) against their reference,
run by the Pallas interpreter on CPU; the GEMV lowered to Triton for an H200 (no GPU needed);
linear()'s choice of path; dummy AWQ weights running a model."""

from __future__ import annotations

import collections
import dataclasses
import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from jaxllm.benchmarks.int4_configs import GEMV_CANDIDATE_TABLES
from jaxllm.pallas_kernels.quantized_matmul import (
    Int4GemvConfig,
    Int4MatmulConfig,
    gemv_config,
    gemv_denormal,
    gemv_unsupported,
    int4_gemv,
    int4_matmul,
    int4_matmul_reference,
    unsupported,
)
from jaxllm.pallas_kernels.quantized_matmul.gemv import GEMV_TABLE
from tiny_models import TINY

import jaxllm
from jaxllm.layers.linear import (
    INT4_GEMV_MAX_TOKENS,
    INT4_KERNEL_MAX_TOKENS,
    Int4Weight,
    int4_kernel,
    int4_uses_kernel,
    linear,
)
from jaxllm.model_config import ModelConfig
from jaxllm.quantization.int4_checkpoint import pack_rows

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
K, N = 256, 128  # the smallest shape with two steps of block_k = 128 (split-K runs)


def int4_weight(k: int, n: int, group: int, dtype, seed: int = 0) -> Int4Weight:
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    groups = k // group
    scales = jnp.asarray(rng.uniform(0.5, 1.5, (groups, n)) * 0.02, dtype)
    zeros = jnp.asarray(rng.integers(0, 17, (groups, n)).astype(np.uint8))  # 16: GPTQ v1
    return Int4Weight(jnp.asarray(pack_rows(q)), scales, zeros)


def assert_close(got, want, x, w: Int4Weight, scale_on_output: bool = False):
    """Both sides dot the same dequantized weight (identical elementwise: (q - z) is exact and
    the product by the scale rounds once in x's dtype) and accumulate in float32 in different
    orders, which differ by at most 2 K eps32 sum_k |x_k w_kn| (the summation bound, twice).
    A bfloat16 result is then rounded once on each side: one more bf16 ulp, 2^-7 |y|.
    ``scale_on_output`` (the GEMV): the kernel multiplies float32 sums of x (q - z) by the
    scale instead of rounding each weight (q - z) s to x's dtype as the reference does, so the
    reference's own weight rounding, half an ulp of each weight (2^-8 in bf16), adds to the
    bound."""
    x32 = np.abs(np.asarray(x, np.float64)).reshape(-1, x.shape[-1])
    w32 = np.abs(np.asarray(w.dequantize(x.dtype), np.float64))
    bound = 2 * x.shape[-1] * np.finfo(np.float32).eps * (x32 @ w32)
    want = np.asarray(want, np.float64).reshape(bound.shape)
    if x.dtype == jnp.bfloat16:
        bound = bound + 2.0 ** -7 * np.abs(want)
        if scale_on_output:
            bound = bound + 2.0 ** -8 * (x32 @ w32)
    err = np.abs(np.asarray(got, np.float64).reshape(bound.shape) - want)
    assert got.dtype == x.dtype
    assert np.all(err <= bound), (err.max(), bound[err > bound][:4])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group", [32, 128, K])
def test_kernel_equals_reference(group, dtype):
    w = int4_weight(K, N, group, dtype)
    for m in (1, 5, 16) if dtype == jnp.float32 else (1, 16):
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, K)), dtype)
        got = int4_matmul(x, w.qweight, w.scales, w.zeros, group_size=group, interpret=True)
        want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=group)
        assert_close(got, want, x, w)


@pytest.mark.parametrize("group", [32, 128, K])
def test_one_dot_kernel_equals_reference(group):
    """The K-ordered tile with one dot a step: groups smaller than, equal to and larger than
    a step, in both dtypes, one and several row blocks."""
    config = Int4MatmulConfig(one_dot=True, block_m=16)
    for dtype in (jnp.float32, jnp.bfloat16):
        w = int4_weight(K, N, group, dtype, seed=2)
        for m in (1, 40):
            x = jnp.asarray(np.random.default_rng(m).standard_normal((m, K)), dtype)
            got = int4_matmul(x, w.qweight, w.scales, w.zeros, group_size=group,
                              interpret=True, config=config)
            want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=group)
            assert_close(got, want, x, w)


def test_kernel_takes_leading_dims_several_row_blocks_and_column_blocks():
    w = int4_weight(K, 2 * N, 128, jnp.float32, seed=1)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 17, K)), jnp.float32)
    config = Int4MatmulConfig(block_m=16, num_splits=1)  # 34 rows: three blocks of 16
    got = int4_matmul(x, w.qweight, w.scales, w.zeros, group_size=128, interpret=True,
                      config=config)
    assert got.shape == (2, 17, 2 * N)
    assert_close(got, int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=128),
                 x, w)


def test_unsupported_shapes_are_named():
    assert unsupported(1, 4096, 28672, 128) is None  # Llama-3-8B gate_up
    assert unsupported(1, 14336, 4096, 128) is None  # its down_proj (112 groups)
    assert unsupported(1, 8192, 57344, 8192) is None  # 70B gate_up, one group
    assert "block_n" in unsupported(1, 256, 96, 128)
    assert "block_k" in unsupported(1, 64, 128, 64)  # the tiny test models' widths
    with pytest.raises(ValueError, match="block_k"):
        Int4MatmulConfig(block_k=64)


# (K, N, group, tokens, dtype, config): groups smaller than a step (32) and one group over
# all K; token counts padded to a power of two (3, 5); N not a multiple of block_n (100); the
# 1-2 token accumulator, the per-step reduction (4, 16) and the dot variant.
GEMV_CASES = [
    (256, 128, 128, 1, jnp.float32, Int4GemvConfig()),
    (256, 128, 32, 3, jnp.float32, Int4GemvConfig(num_splits=2)),
    (512, 100, 64, 5, jnp.bfloat16, Int4GemvConfig(block_n=32)),
    (256, 128, 256, 16, jnp.bfloat16, Int4GemvConfig(block_words=8, num_splits=4)),
    (256, 128, 128, 16, jnp.bfloat16, Int4GemvConfig(dot=True, evict_first=True)),
    (128, 96, 32, 2, jnp.bfloat16, Int4GemvConfig(block_n=64, num_warps=2)),
    # The tuned configs of the 8B projections (GEMV_TABLE), each at a small shape.
    *[(512, 320, 128, 1, jnp.bfloat16, config) for config in GEMV_TABLE.values()],
    # The denormal loop without the byte permute (a shift a word), with the next step's words
    # prefetched, and the 2^23-magic loop.
    (256, 100, 64, 2, jnp.bfloat16, Int4GemvConfig(block_n=64, byte_permute=False)),
    (512, 128, 64, 1, jnp.float32, Int4GemvConfig(block_words=4, prefetch=True)),  # 8 steps
    (256, 128, 32, 1, jnp.float32, Int4GemvConfig(num_splits=2, denormal=False)),
    # The products nibble by nibble across a step's rows (each step's loads first): one and
    # several steps, pairs and shifts, x in the kernel, the last split's sum.
    (512, 320, 128, 1, jnp.bfloat16, Int4GemvConfig(block_n=256, num_warps=2,
                                                    loads_first=True)),
    (512, 100, 64, 2, jnp.float32, Int4GemvConfig(block_n=64, block_words=4, loads_first=True,
                                                  byte_permute=False, num_splits=2)),
    (256, 96, 64, 3, jnp.bfloat16, Int4GemvConfig(block_n=32, x_in_kernel=True,
                                                  splits_sum="last", loads_first=True)),
    # each program letting the next kernel launch at its start (PDL; nothing in interpret)
    (512, 320, 128, 2, jnp.bfloat16, Int4GemvConfig(block_n=64, trigger_dependents=True)),
    # every config of int4_configs' candidate tables (down: 8 rows a step, prefetched)
    *[(512, 320, 128, 1, jnp.bfloat16, Int4GemvConfig(**fields))
      for table in GEMV_CANDIDATE_TABLES.values() for fields in table.values()],
]


@pytest.mark.parametrize("k,n,group,m,dtype,config", GEMV_CASES)
def test_gemv_equals_reference(k, n, group, m, dtype, config):
    w = int4_weight(k, n, group, dtype, seed=m)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), dtype)
    got = int4_gemv(x, w.qweight, w.scales, w.zeros, group_size=group, interpret=True,
                    config=config)
    assert got.shape == (m, n)
    want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=group)
    assert_close(got, want, x, w, scale_on_output=True)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_gemv_lowers_to_triton_for_the_h200():
    """The Triton lowering (run by JAX in Python; no GPU needed) of the shapes the engine runs:
    catches a primitive with no Triton rule or a load that is not a power of two in size,
    which interpret mode does not."""
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    cases = [(1, 4096, 28672, 128, None), (4, 14336, 4096, 128, None),
             *[(m, k, n, 128, None) for m, k, n in GEMV_TABLE],  # the table's configs
             (16, 4096, 6144, 128, Int4GemvConfig(dot=True)), (3, 512, 100, 32, None),
             (1, 4096, 4096, 128, Int4GemvConfig(denormal=False)),
             # one split: x's dtype stored straight into [M, N], masked past N = 100
             (1, 512, 100, 32, Int4GemvConfig(num_splits=1)),
             (2, 512, 100, 32, Int4GemvConfig(num_splits=1, denormal=False)),
             (1, 4096, 4096, 128, Int4GemvConfig(splits_sum="atomic")),
             (1, 4096, 4096, 128, Int4GemvConfig(splits_sum="last")),
             (2, 14336, 4096, 128, Int4GemvConfig(denormal=False, splits_sum="last")),
             (1, 4096, 6144, 128, Int4GemvConfig(x_in_kernel=False)),
             (1, 14336, 4096, 128, Int4GemvConfig(block_n=256, num_warps=2, loads_first=True))]
    for m, k, n, group, config in cases:
        args = [jax.ShapeDtypeStruct(s, d) for s, d in [
            ((m, k), jnp.bfloat16), ((k // 8, n), jnp.int32), ((k // group, n), jnp.bfloat16),
            ((k // group, n), jnp.uint8)]]
        fn = jax.jit(lambda x, q, s, z, g=group, c=config: int4_gemv(x, q, s, z, group_size=g,
                                                                     config=c))
        with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
            text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text and "int4_gemv" in text


@pytest.mark.parametrize("pairs", [True, False])
def test_denormal_unpack_reads_each_nibble_times_x_exactly(pairs):
    """The GPU path's arithmetic, in numpy (which keeps float32 subnormals; XLA:CPU, and so
    interpret mode, flushes them): each masked nibble read as a float32 times x scaled by an
    exponent add (scale_x) is q x 2^-X_EXP exactly, for every nibble and row parity; a zero or
    subnormal x gives a product of zero (as the exact product rounds to)."""
    rng = np.random.default_rng(0)
    words = rng.integers(-2**31, 2**31, (4, 8), dtype=np.int64).astype(np.int32)  # [K/8, N]
    q = (words.astype(np.int64)[:, None, :] >> (4 * np.arange(8))[None, :, None]) & 0xF
    x = rng.standard_normal((4, 8)).astype(jnp.bfloat16)  # [K/8, 8]
    # the largest |x| the scaling keeps finite is below 2^43; zeros; bf16 subnormals; tiny
    x[0, :6] = [2.0**42, 0.0, -0.0, 2.0**-130, -2.0**-133, -2.0**-120]
    cols = [jnp.asarray(w) for w in words]
    for r in range(4):
        for j, (src, pos) in enumerate(gemv_denormal.denormal_nibbles(cols, r, pairs, True)):
            w = (np.asarray(src) & (0xF << pos)).view(np.float32)
            unit = gemv_denormal.x_unit(r, j, pairs, interpret=False)
            xs = np.float32(gemv_denormal.scale_x(jnp.asarray(x[r, j]), unit, False))
            got = w * xs  # float32 products, subnormals kept
            want = q[r, j] * np.float64(x[r, j]) * 2.0**-gemv_denormal.X_EXP
            np.testing.assert_array_equal(got, np.float32(want))
            if abs(x[r, j]) >= 2.0**-126:  # normal: the scaling and the product are exact
                assert np.float64(xs) == np.float64(x[r, j]) * 2.0**unit
                np.testing.assert_array_equal(np.float64(w) * np.float64(xs), want)


def test_scale_x_of_float32_is_an_exact_power_of_two_multiple():
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32) * 2.0**30
    for unit in (-64, 21, 85):
        got = np.asarray(gemv_denormal.scale_x(jnp.asarray(x), unit, False), np.float64)
        np.testing.assert_array_equal(got, x.astype(np.float64) * 2.0**unit)


# The denormal loop reading x as it is (scaled and summed per step in the kernel): K of one
# to several steps a split, N with a partial last column block (100, 200) or not, groups
# smaller than, equal to and larger than a step, 1-2 tokens (3: padded nowhere now), one
# split (x's dtype stored straight into [M, N], masked past N) or several (f32 partials
# summed by XLA, added atomically, or summed by the last split), with and without the byte
# permute.
FOLDED_CASES = [
    (128, 100, 32, 1, jnp.bfloat16, dict(block_n=64, num_splits=1)),
    (256, 200, 64, 2, jnp.bfloat16, dict(block_n=128, num_splits=1, block_words=4)),
    (512, 256, 128, 1, jnp.float32, dict(block_n=128, num_splits=1)),
    (512, 100, 32, 2, jnp.float32, dict(block_n=64, num_splits=4)),
    (1024, 256, 128, 1, jnp.bfloat16, dict(block_n=256, num_warps=2, num_splits=8)),
    (1024, 96, 256, 2, jnp.bfloat16, dict(block_n=32, num_splits=2, byte_permute=False)),
    (256, 100, 64, 3, jnp.float32, dict(block_n=64, num_splits=2)),
    (512, 200, 64, 1, jnp.bfloat16, dict(block_n=128, num_splits=4, splits_sum="atomic")),
    (256, 128, 32, 2, jnp.float32, dict(block_n=64, num_splits=8, splits_sum="atomic")),
    (256, 100, 128, 1, jnp.bfloat16, dict(block_n=64, num_splits=2, denormal=False,
                                          splits_sum="atomic")),
    (512, 200, 64, 2, jnp.bfloat16, dict(block_n=128, num_splits=4, splits_sum="last")),
    (1024, 96, 128, 1, jnp.float32, dict(block_n=32, num_splits=8, splits_sum="last")),
    (256, 100, 32, 2, jnp.bfloat16, dict(block_n=64, num_splits=2, denormal=False,
                                         splits_sum="last")),
    (256, 100, 128, 2, jnp.bfloat16, dict(block_n=64, num_splits=1, denormal=False)),
    # x scaled and summed by XLA before the call instead
    (512, 100, 32, 2, jnp.bfloat16, dict(block_n=64, num_splits=4, x_in_kernel=False)),
    (256, 96, 64, 1, jnp.float32, dict(block_n=32, num_splits=1, x_in_kernel=False,
                                       byte_permute=False)),
]


@pytest.mark.parametrize("k,n,group,m,dtype,fields", FOLDED_CASES)
def test_gemv_reads_x_in_the_kernel_and_equals_reference(k, n, group, m, dtype, fields):
    w = int4_weight(k, n, group, dtype, seed=k + n + m)
    x = jnp.asarray(np.random.default_rng(n).standard_normal((m, k)), dtype)
    x = x.at[:, 5].set(0)  # a zero activation: no term, no share of the zero-point sum
    config = Int4GemvConfig(**fields)
    got = int4_gemv(x, w.qweight, w.scales, w.zeros, group_size=group, interpret=True,
                    config=config)
    assert got.shape == (m, n) and config.splits(k, n, group) == fields["num_splits"]
    want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=group)
    assert_close(got, want, x, w, scale_on_output=True)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("mode", ["xla", "atomic", "last"])
def test_gemv_is_one_kernel_and_at_most_the_split_sum_for_the_8b_projections(mode):
    """The program around the kernel, lowered for the H200 at one token: x goes in as it is (no
    XLA pad, multiply or reduce before the call); after it, the sum over the splits (one
    reduce) and the cast ("xla"), only the cast ("atomic": and the zeros it adds into), or
    nothing ("last": only the zeroed counters before)."""
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    for m, k, n in GEMV_TABLE:
        args = [jax.ShapeDtypeStruct(s, d) for s, d in [
            ((m, k), jnp.bfloat16), ((k // 8, n), jnp.int32), ((k // 128, n), jnp.bfloat16),
            ((k // 128, n), jnp.uint8)]]
        config = dataclasses.replace(GEMV_TABLE[m, k, n], splits_sum=mode, x_in_kernel=True)
        fn = jax.jit(lambda x, q, s, z, c=config: int4_gemv(x, q, s, z, group_size=128,
                                                            config=c))
        with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
            text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        ops = collections.Counter(re.findall(r"stablehlo\.(\w+)", text))
        assert ops["custom_call"] == 1
        assert not {"pad", "multiply", "slice", "concatenate"} & set(ops), ops
        assert ops["reduce"] == (mode == "xla") and ops["convert"] == (mode != "last"), ops


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the splits' atomics need a GPU")
@pytest.mark.parametrize("m,k,n", [(1, 4096, 6144), (2, 4096, 28672), (1, 14336, 4096)])
def test_gemv_splits_sums_on_the_gpu_equal_reference_and_last_is_reproducible(m, k, n):
    """Compiled (not interpreted): the splits added by atomics or by the last split racing on
    real SMs, against the reference; "last" bit-for-bit the same over repeated calls."""
    w = int4_weight(k, n, 128, jnp.bfloat16, seed=m)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
    want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=128)
    for mode in ("xla", "atomic", "last"):
        config = dataclasses.replace(gemv_config(m, k, n, 128), splits_sum=mode)
        run = jax.jit(lambda x, c=config: int4_gemv(x, w.qweight, w.scales, w.zeros,
                                                     group_size=128, config=c))
        got = run(x)
        assert_close(got, want, x, w, scale_on_output=True)
        if mode == "last":
            for _ in range(10):
                np.testing.assert_array_equal(np.asarray(run(x), np.float32),
                                              np.asarray(got, np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled GEMV configs need a GPU")
@pytest.mark.parametrize("m,k,n", [(1, 4096, 6144), (1, 4096, 28672), (1, 14336, 4096),
                                   (2, 4096, 4096)])
def test_gemv_loading_each_step_first_on_the_gpu_equals_reference(m, k, n):
    """Compiled: the products nibble by nibble across each step's rows (loads_first) at the
    8B projections, on GEMV_TABLE's configs and on int4_configs' candidate table
    "loads_first" (down on the denormal loop, prefetching), against the reference."""
    from jaxllm.benchmarks.int4_configs import GEMV_CANDIDATE_TABLES

    w = int4_weight(k, n, 128, jnp.bfloat16, seed=k + m)
    x = jnp.asarray(np.random.default_rng(n).standard_normal((m, k)), jnp.bfloat16)
    want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=128)
    listed = GEMV_CANDIDATE_TABLES["loads_first"].get((m, k, n), dict(loads_first=True))
    for config in (dataclasses.replace(gemv_config(m, k, n, 128), loads_first=True),
                   Int4GemvConfig(**listed)):
        got = int4_gemv(x, w.qweight, w.scales, w.zeros, group_size=128, config=config)
        assert_close(got, want, x, w, scale_on_output=True)


def test_gemv_unsupported_shapes_and_configs_are_named():
    assert gemv_unsupported(1, 4096, 28672, 128) is None
    assert gemv_unsupported(16, 8192, 57344, 8192) is None  # 70B gate_up, one group
    assert gemv_unsupported(1, 64, 96, 32) is None  # the tiny models' widths
    assert "group_size" in gemv_unsupported(1, 256, 128, 100)
    assert "dot" in gemv_unsupported(16, 256, 128, 64, Int4GemvConfig(dot=True))
    assert "splits" in gemv_unsupported(1, 256, 128, 128, Int4GemvConfig(num_splits=4))
    with pytest.raises(ValueError, match="block_n"):
        Int4GemvConfig(block_n=96)
    with pytest.raises(ValueError, match="block_words"):
        Int4GemvConfig(block_words=8, dot=True)
    with pytest.raises(ValueError, match="splits_sum"):
        Int4GemvConfig(splits_sum="tree")


def test_linear_runs_the_kernels_only_where_asked_and_able():
    w = int4_weight(K, N, 128, jnp.float32)
    x = jnp.ones((4, K), jnp.float32)
    assert jax.default_backend() == "cpu"
    assert not int4_uses_kernel(x, w)  # auto: the kernels are for GPUs
    assert int4_kernel(x, w, "pallas_interpret") == "gemv"
    assert not int4_uses_kernel(x, w, "xla")
    more = jnp.ones((INT4_GEMV_MAX_TOKENS + 1, K), jnp.float32)
    assert int4_kernel(more, w, "pallas") == "matmul"
    many = jnp.ones((INT4_KERNEL_MAX_TOKENS + 1, K), jnp.float32)
    assert not int4_uses_kernel(many, w, "pallas")
    small = int4_weight(64, N, 32, jnp.float32)  # K=64: the GEMV takes it, the matmul cannot
    assert int4_kernel(jnp.ones((1, 64)), small, "pallas") == "gemv"
    assert not int4_uses_kernel(jnp.ones((INT4_GEMV_MAX_TOKENS + 1, 64)), small, "pallas")
    tp2 = types.SimpleNamespace(shape={"tp": 2})  # sharded weights keep XLA's path
    assert not int4_uses_kernel(x, w, "pallas", mesh=tp2)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), w)  # [L, ..]: only per-layer slices
    assert not int4_uses_kernel(x, stacked, "pallas")
    with pytest.raises(ValueError, match="int4 backend"):
        int4_uses_kernel(x, w, "triton")


def test_linear_on_cpu_is_the_xla_path_bit_for_bit_and_the_kernel_agrees():
    w = int4_weight(K, N, 32, jnp.bfloat16, seed=2)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, K)), jnp.bfloat16)
    before = jnp.dot(x, w.dequantize(x.dtype))  # linear()'s 4-bit path before the kernel
    np.testing.assert_array_equal(np.asarray(linear(x, w), np.float32),
                                  np.asarray(before, np.float32))
    assert_close(linear(x, w, int4_backend="pallas_interpret"), before, x, w,
                 scale_on_output=True)  # 3 tokens: the GEMV


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dummy_int4_weights_are_packed_and_generate(method):
    cfg = ModelConfig(**TINY, rope_theta=10000.0)
    model = jaxllm.load_model(load_format="dummy", config=cfg, quantization=method)
    assert model.quantization.method == method and model.quantization.bits == 4
    assert model.quantization.group_size == 32  # 128 and 64 do not divide the MLP's 96
    kernel = model.params["layers"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(kernel, Int4Weight)
    assert kernel.qweight.shape == (2, 96 // 8, 64) and kernel.zeros.dtype == jnp.uint8
    assert int(kernel.zeros.max()) <= 15 and float(kernel.scales.min()) > 0
    if method == "gptq":  # the same packed layout runs the same way: generate once (awq)
        return
    ids = jnp.asarray([[1, 2, 3, 0]], jnp.int32)
    out = jaxllm.generate(model.params, ids, jnp.asarray([3]), jax.random.key(0), config=cfg,
                          max_new_tokens=2, block_size=4)
    assert out.tokens.shape == (1, 2)
    assert np.all((np.asarray(out.tokens) >= 0) & (np.asarray(out.tokens) < cfg.vocab_size))


def test_step_profiles_gemv_overrides_reach_the_gemv_pick_and_its_own_cache(monkeypatch):
    """``step_profile --gemv-overrides``: every non-dot GEMV config the engine's kernels pick
    gets the fields (strings too), the dot configs stay, and the programs compile into a cache
    directory of their own (the executable cache would hand back the unpatched programs)."""
    from jaxllm.benchmarks.step_profile import override_gemv
    from jaxllm.pallas_kernels.quantized_matmul import gemv

    monkeypatch.setattr(gemv, "gemv_config", gemv.gemv_config)  # undone after the test
    cache = override_gemv("splits_sum=last,x_in_kernel=True")
    picked = gemv.gemv_config(1, 4096, 6144, 128)  # Llama-3-8B qkv at one token
    assert (picked.splits_sum, picked.x_in_kernel) == ("last", True)
    assert gemv.gemv_config(16, 4096, 6144, 128).dot  # the dot keeps its own config
    assert cache.endswith("xla-gemv-splits_sum-last-x_in_kernel-True")
    w = int4_weight(K, N, 128, jnp.float32)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, K)), jnp.float32)
    got = int4_gemv(x, w.qweight, w.scales, w.zeros, group_size=128, interpret=True)
    want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=128)
    assert_close(got, want, x, w, scale_on_output=True)


def test_gemv_overrides_take_a_candidate_table(monkeypatch):
    """``--gemv-overrides table=loads_first,...``: the candidate table's config for the shapes
    it lists, the pick elsewhere, the other fields over both; an unknown table is named."""
    from jaxllm.benchmarks.int4_configs import GEMV_CANDIDATE_TABLES
    from jaxllm.benchmarks.step_profile import override_gemv
    from jaxllm.pallas_kernels.quantized_matmul import gemv

    monkeypatch.setattr(gemv, "gemv_config", gemv.gemv_config)  # undone after the test
    with pytest.raises(SystemExit, match="no candidate table 'nope'"):
        override_gemv("table=nope")
    override_gemv("table=loads_first,loads_first=True")
    down = gemv.gemv_config(1, 14336, 4096, 128)
    assert down == Int4GemvConfig(**GEMV_CANDIDATE_TABLES["loads_first"][1, 14336, 4096])
    assert down.denormal and down.prefetch and down.block_words == 8
    other = gemv.gemv_config(1, 8192, 1024, 128)  # not listed: the rule's pick, loads first
    assert other.loads_first and other.block_n == 256
    assert gemv.gemv_config(16, 4096, 6144, 128).dot
