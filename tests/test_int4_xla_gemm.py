"""XLA's own int4 GEMM for 4-bit projections (pallas_kernels/quantized_matmul/xla_int4.py):
the same product as the reference, within the rounding of its centred weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.pallas_kernels.quantized_matmul import int4_matmul_reference, int4_matmul_xla_int4
from jaxllm.pallas_kernels.quantized_matmul.xla_int4 import COMPILE_OPTIONS, centred_nibbles
from test_int4_kernel import int4_weight

K, N = 256, 128


def assert_close_to_reference(got, x, w):
    """The reference rounds each weight (q - z) s once in x's dtype; this path rounds
    (q - 8) s (|q - 8| <= 8) and subtracts (z - 8) s in float32: each weight differs by at most
    half an ulp of 8 s on either side, so the outputs by 2^-8 sum_k |x_k| 8 s[k // g, n] in
    bf16 (float32: 2^-23 of it), plus both sides' float32 summation (2 K eps32 sum |x w|) and,
    in bf16, the two final roundings (2^-7 |y|)."""
    want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=w.group_size)
    x64 = np.abs(np.asarray(x, np.float64)).reshape(-1, x.shape[-1])
    w64 = np.abs(np.asarray(w.dequantize(jnp.float32), np.float64))
    s64 = np.repeat(np.asarray(w.scales, np.float64), w.group_size, axis=0)
    ulp = 2.0 ** -8 if x.dtype == jnp.bfloat16 else 2.0 ** -23
    bound = 2 * K * np.finfo(np.float32).eps * (x64 @ w64) + ulp * (x64 @ (8 * s64))
    want = np.asarray(want, np.float64).reshape(bound.shape)
    if x.dtype == jnp.bfloat16:
        bound = bound + 2.0 ** -7 * np.abs(want)
    err = np.abs(np.asarray(got, np.float64).reshape(bound.shape) - want)
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], N)
    assert np.all(err <= bound), (err.max(), bound[err > bound][:4])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group", [32, 128, K])
def test_xla_int4_gemm_equals_reference(group, dtype):
    w = int4_weight(K, N, group, dtype, seed=group)
    for shape in ((1, K), (70, K), (2, 3, K)):
        x = jnp.asarray(np.random.default_rng(len(shape)).standard_normal(shape), dtype)
        got = int4_matmul_xla_int4(x, w.qweight, w.scales, w.zeros, group_size=group)
        assert_close_to_reference(got, x, w)


def test_centred_nibbles_are_the_packed_values_less_eight():
    w = int4_weight(K, N, 32, jnp.float32, seed=5)
    nibbles = centred_nibbles(w.qweight)
    assert nibbles.dtype == jnp.int4 and nibbles.shape == (K, N)
    ones = jnp.ones_like(w.scales)  # (q - 8) x 1: the unpacked nibbles, centred
    want = int4_matmul_reference(jnp.eye(K), w.qweight, ones, jnp.full_like(w.zeros, 8),
                                 group_size=32)
    np.testing.assert_array_equal(np.asarray(nibbles, np.float32), np.asarray(want))


def test_bad_group_sizes_and_stacked_weights_are_named():
    w = int4_weight(K, N, 32, jnp.float32)
    x = jnp.ones((1, K))
    with pytest.raises(ValueError, match="group_size=64 does not give scales' 8 groups"):
        int4_matmul_xla_int4(x, w.qweight, w.scales, w.zeros, group_size=64)
    with pytest.raises(ValueError, match="a 2-D weight"):
        int4_matmul_xla_int4(x, w.qweight[None], w.scales[None], w.zeros[None], group_size=32)


def test_a_cpu_compile_takes_the_gpu_option():
    """int4_matmul's --xla-int4 compiles with it on every backend."""
    x = jnp.ones((3, K), jnp.bfloat16)
    w = int4_weight(K, N, 128, jnp.bfloat16)
    compiled = jax.jit(lambda *a: int4_matmul_xla_int4(*a, group_size=128)).lower(
        x, w.qweight, w.scales, w.zeros).compile(compiler_options=COMPILE_OPTIONS)
    assert_close_to_reference(compiled(x, w.qweight, w.scales, w.zeros), x, w)
