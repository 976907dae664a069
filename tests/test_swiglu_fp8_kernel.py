"""The one-pass SwiGLU + per-token FP8 quantization kernel (pallas_kernels/activation_quant)
against its reference in Pallas' interpreter, the reference against what the model computes
between an FP8 MLP's two GEMMs (jaxllm.layers.linear), and the model's MLP through the kernel
(jaxllm.layers.mlp) against XLA's passes."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.pallas_kernels.activation_quant import (
    swiglu_quantize_fp8,
    swiglu_quantize_fp8_reference,
    unsupported,
)
from tiny_models import prompt_logits

import jaxllm
from jaxllm.layers import fp8_kernels, mlp
from jaxllm.layers.linear import linear, quantize_fp8, quantize_tokens_fp8

TINY_QWEN = os.path.join(os.path.dirname(__file__), "fixtures", "tiny", "qwen2_bias")


def _gate_up_product(tokens: int, f: int, dtype, seed: int = 0):
    """An FP8 gate_up projection's GEMM, as linear() runs it: (product, x_scale, w_scale)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, 32)) * rng.uniform(0.1, 5, (tokens, 1)), dtype)
    weight = quantize_fp8(jnp.asarray(rng.standard_normal((32, 2 * f)) * 0.2, dtype))
    xq, x_scale = quantize_tokens_fp8(x)
    product = jax.lax.dot_general(xq, weight.qt, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    return x, weight, product, x_scale, weight.scale


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_is_what_the_model_computes_between_the_gemms(dtype):
    x, weight, product, x_scale, w_scale = _gate_up_product(6, 40, dtype)
    # the model: gate_up = linear(x, W) in dtype, silu(gate) * up, down's input quantized
    pairs = linear(x, weight).reshape(6, 40, 2)
    want_q, want_scale = quantize_tokens_fp8(nn.silu(pairs[..., 0]) * pairs[..., 1])
    q, scale = swiglu_quantize_fp8_reference(product, x_scale, w_scale, dtype)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))


@pytest.mark.parametrize("tokens, f", [(5, 48), (3, 64), (2, 1), (4, 100), (2, 4096 + 2048)])
def test_interpreted_kernel_equals_reference_in_float32(tokens, f):
    _, _, product, x_scale, w_scale = _gate_up_product(tokens, f, jnp.float32, seed=f)
    q, scale = swiglu_quantize_fp8(product, x_scale, w_scale, jnp.float32, interpret=True)
    want_q, want_scale = swiglu_quantize_fp8_reference(product, x_scale, w_scale, jnp.float32)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (tokens, f) and scale.shape == (tokens, 1)
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))


def test_interpreted_kernel_is_within_one_fp8_step_of_reference_in_bfloat16():
    # The kernel computes silu(gate) up in float32 and rounds once; the reference rounds each
    # bf16 op: h differs by a bf16 ulp (2^-8) at most, which moves an FP8 value (steps of
    # 2^-3) by one step at most, and rarely.
    _, _, product, x_scale, w_scale = _gate_up_product(16, 96, jnp.bfloat16, seed=3)
    q, scale = swiglu_quantize_fp8(product, x_scale, w_scale, jnp.bfloat16, interpret=True)
    want_q, want_scale = swiglu_quantize_fp8_reference(product, x_scale, w_scale, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=2**-7)
    got, want = np.asarray(q, np.float32), np.asarray(want_q, np.float32)
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0**-6))) - 3)
    assert np.all(np.abs(got - want) <= step), np.abs(got - want).max()
    assert np.mean(got == want) > 0.9


def test_shapes_the_kernel_cannot_take_are_named():
    assert unsupported((4, 64)) is None
    assert "must be [T, 2F]" in unsupported((4, 63))
    assert "must be [T, 2F]" in unsupported((2, 4, 64))
    with pytest.raises(ValueError, match="must be"):
        swiglu_quantize_fp8(jnp.zeros((4, 63)), jnp.ones((4, 1)), jnp.ones(63), jnp.float32,
                            interpret=True)


# The engine's use of the kernel (jaxllm.layers.mlp): picked by JAXLLM_FP8_SWIGLU_KERNEL.

def test_the_kernel_setting_is_read_from_the_environment_and_refused_when_unknown():
    assert fp8_kernels.swiglu_kernel_setting({}) == "off"
    env = fp8_kernels.SWIGLU_KERNEL_ENV
    assert fp8_kernels.swiglu_kernel_setting({env: " bf16 "}) == "bf16"
    with pytest.raises(ValueError, match=r"JAXLLM_FP8_SWIGLU_KERNEL='fp16' must be one of"):
        fp8_kernels.swiglu_kernel_setting({env: "fp16"})


def test_the_kernel_runs_only_between_two_fp8_projections():
    gate_up, down = (quantize_fp8(jnp.ones(shape)) for shape in ((8, 32), (16, 8)))
    product_dtype = fp8_kernels.swiglu_product_dtype
    assert product_dtype(gate_up, down, setting="f32") == jnp.float32
    assert product_dtype(gate_up, down, setting="bf16") == jnp.bfloat16
    assert product_dtype(gate_up, down, setting="off") is None
    assert product_dtype(gate_up, jnp.ones((16, 8)), setting="f32") is None
    assert product_dtype(quantize_fp8(jnp.ones((2, 8, 32))), down, setting="f32") is None


@pytest.mark.parametrize("dtype, product_dtype", [(jnp.float32, jnp.float32),
                                                  (jnp.bfloat16, jnp.float32),
                                                  (jnp.bfloat16, jnp.bfloat16)])
def test_the_mlp_through_the_kernel_matches_xlas_passes(dtype, product_dtype):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((70, 32)), dtype)
    gate_up = quantize_fp8(jnp.asarray(rng.standard_normal((32, 2 * 48)) * 0.3, dtype))
    down = quantize_fp8(jnp.asarray(rng.standard_normal((48, 32)) * 0.3, dtype))
    want = np.asarray(mlp.swiglu_mlp(x, gate_up, down), np.float32)
    got = mlp.swiglu_mlp(x, gate_up, down, product_dtype=product_dtype)
    assert got.dtype == dtype and got.shape == (70, 32)
    got = np.asarray(got, np.float32)
    if dtype == jnp.float32:  # the reference's math exactly (test above): the same FP8 inputs
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:  # an FP8 step on a few elements of down's input (test above), a bf16 product
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.03


def test_an_fp8_model_forward_through_the_kernel_matches_xlas_passes(monkeypatch):
    model = jaxllm.load_model(TINY_QWEN, dtype="float32", quantization="fp8")
    ids = [int(i) for i in np.random.default_rng(0).integers(1, 100, 80)]
    monkeypatch.setenv(fp8_kernels.SWIGLU_KERNEL_ENV, "off")
    want = prompt_logits(model, ids)
    monkeypatch.setenv(fp8_kernels.SWIGLU_KERNEL_ENV, "f32")
    traced = []  # the kernel's calls as the forward is traced
    kernel = mlp.swiglu_quantize_fp8
    monkeypatch.setattr(mlp, "swiglu_quantize_fp8",
                        lambda *a, **k: traced.append(a[0].shape) or kernel(*a, **k))
    got = prompt_logits(model, ids)
    assert traced and set(traced) == {(80, 2 * model.config.intermediate_size)}
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
