"""XLA's own int4 GEMM for 4-bit projections (pallas_kernels/quantized_matmul/xla_int4.py):
the same product as the reference, within the rounding of its centred weights, and how the
engine picks it (JAXLLM_INT4_XLA_GEMM, the forward's compile options)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.pallas_kernels.quantized_matmul import int4_matmul_reference, int4_matmul_xla_int4
from jaxllm.pallas_kernels.quantized_matmul.xla_int4 import COMPILE_OPTIONS, centred_nibbles
from test_int4_kernel import int4_weight
from test_quant_int4 import write_tiny

import jaxllm
from jaxllm.layers.linear import INT4_GEMM_ENV, int4_xla_gemm, linear
from jaxllm.quantization import QuantizationConfig
from jaxllm.quantization import compile_options as co

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


def test_linear_takes_xlas_int4_gemm_only_when_the_environment_says(monkeypatch):
    w = int4_weight(K, N, 128, jnp.bfloat16, seed=3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((80, K)), jnp.bfloat16)
    parts = (w.qweight, w.scales, w.zeros)
    monkeypatch.delenv(INT4_GEMM_ENV, raising=False)
    np.testing.assert_array_equal(  # CPU: the reference, as before the option existed
        np.asarray(linear(x, w), np.float32),
        np.asarray(int4_matmul_reference(x, *parts, group_size=128), np.float32))
    monkeypatch.setenv(INT4_GEMM_ENV, "int4")
    jaxpr = str(jax.make_jaxpr(linear)(x, w))
    assert "i4[256,128]" in jaxpr, jaxpr
    np.testing.assert_array_equal(
        np.asarray(linear(x, w), np.float32),
        np.asarray(int4_matmul_xla_int4(x, *parts, group_size=128), np.float32))


def test_the_setting_and_the_compile_options_it_brings():
    assert int4_xla_gemm({}) == "dequantize"
    assert int4_xla_gemm({INT4_GEMM_ENV: " int4 "}) == "int4"
    with pytest.raises(ValueError, match=r"JAXLLM_INT4_XLA_GEMM='s4' must be one of"):
        int4_xla_gemm({INT4_GEMM_ENV: "s4"})
    awq = QuantizationConfig("awq", bits=4, group_size=128)
    gptq = QuantizationConfig("gptq", bits=4, group_size=128)
    assert co.forward_compiler_options(awq, {}) == {}
    for method in (awq, gptq):
        assert co.forward_compiler_options(method, {INT4_GEMM_ENV: "int4"}) == COMPILE_OPTIONS
    assert co.forward_compiler_options(None, {INT4_GEMM_ENV: "int4"}) == {}
    # a CPU compile takes the GPU option (the CPU machine's tests run the engine with it)
    compiled = jax.jit(lambda a: a + 1).lower(jnp.ones(2)).compile(
        compiler_options=COMPILE_OPTIONS)
    np.testing.assert_array_equal(np.asarray(compiled(jnp.ones(2))), [2, 2])


def test_the_engine_refuses_a_bad_setting_before_loading(monkeypatch):
    monkeypatch.setenv(INT4_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="JAXLLM_INT4_XLA_GEMM='fast'"):
        jaxllm.LLM("/nonexistent/model", progress=False)


def test_a_tiny_awq_model_generates_through_xlas_int4_gemm(tmp_path, monkeypatch):
    """The engine's forward, compiled with the option, on the CPU backend (every 4-bit
    projection takes XLA's path there): the same greedy tokens as through the reference."""
    path = write_tiny(tmp_path, "awq")
    tokens = {}
    for setting in ("dequantize", "int4"):
        monkeypatch.setenv(INT4_GEMM_ENV, setting)
        llm = jaxllm.LLM(path, quantization="awq", max_num_seqs=2, max_model_len=64,
                         enforce_eager=True, compilation_cache_dir=None, progress=False)
        out = llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]],
                           sampling_params=jaxllm.SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)
        tokens[setting] = [o.outputs[0].token_ids for o in out]
    assert tokens["int4"] == tokens["dequantize"] and len(tokens["int4"][0]) == 4
