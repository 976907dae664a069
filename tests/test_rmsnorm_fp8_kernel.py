"""The one-pass RMSNorm + per-token FP8 quantization kernel (pallas_kernels/activation_quant)
against its reference in Pallas' interpreter, the reference against what the model computes
before an FP8 projection, and the model through the kernel (JAXLLM_FP8_NORM_KERNEL) against
XLA's passes."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.pallas_kernels.activation_quant import (
    rmsnorm_fp8,
    rmsnorm_quantize_fp8,
    rmsnorm_quantize_fp8_reference,
)
from tiny_models import prompt_logits

import jaxllm
from jaxllm.layers import fp8_kernels
from jaxllm.layers.linear import quantize_tokens_fp8
from jaxllm.models.llama import RMSNorm

TINY_QWEN = os.path.join(os.path.dirname(__file__), "fixtures", "tiny", "qwen2_bias")


def _stream(tokens: int, hidden: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)) * rng.uniform(0.1, 5, (tokens, 1))
    weight = 1 + 0.2 * rng.standard_normal(hidden)
    return jnp.asarray(x, dtype), jnp.asarray(weight, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_is_the_models_norm_then_the_projections_quantization(dtype):
    x, weight = _stream(6, 64, dtype)
    normed = RMSNorm(1e-5, dtype).apply({"params": {"scale": weight}}, x)
    want_q, want_scale = quantize_tokens_fp8(normed)
    q, scale = rmsnorm_quantize_fp8_reference(x, weight, 1e-5)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))


@pytest.mark.parametrize("tokens, hidden", [(5, 64), (1, 16), (3, 4096)])
def test_interpreted_kernel_equals_reference_in_float32(tokens, hidden):
    x, weight = _stream(tokens, hidden, jnp.float32, seed=hidden)
    q, scale = rmsnorm_quantize_fp8(x, weight, 1e-6, interpret=True)
    want_q, want_scale = rmsnorm_quantize_fp8_reference(x, weight, 1e-6)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == x.shape and scale.shape == (tokens, 1)
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=1e-6)
    got, want = np.asarray(q, np.float32), np.asarray(want_q, np.float32)
    assert np.mean(got == want) > 0.999, np.mean(got == want)


def test_interpreted_kernel_is_within_one_fp8_step_of_reference_in_bfloat16():
    # The mean of squares is summed in another order than XLA's: the normalized value may round
    # to the neighbouring bf16 (2^-8 apart), which moves its FP8 value (2^-3 apart) by one
    # step at most, and rarely.
    x, weight = _stream(16, 256, jnp.bfloat16, seed=3)
    q, scale = rmsnorm_quantize_fp8(x, weight, 1e-5, interpret=True)
    want_q, want_scale = rmsnorm_quantize_fp8_reference(x, weight, 1e-5)
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=2**-7)
    got, want = np.asarray(q, np.float32), np.asarray(want_q, np.float32)
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0**-6))) - 3)
    assert np.all(np.abs(got - want) <= step), np.abs(got - want).max()
    assert np.mean(got == want) > 0.9


def test_shapes_the_kernel_cannot_take_are_named():
    assert rmsnorm_fp8.unsupported((4, 4096)) is None
    assert "power of two" in rmsnorm_fp8.unsupported((4, 576))
    assert "power of two" in rmsnorm_fp8.unsupported((4, 32768))
    assert "must be [T, H]" in rmsnorm_fp8.unsupported((2, 4, 64))
    with pytest.raises(ValueError, match="power of two"):
        rmsnorm_quantize_fp8(jnp.zeros((4, 576)), jnp.ones(576), 1e-5, interpret=True)


def test_the_norm_kernel_setting_is_read_from_the_environment_and_refused_when_unknown():
    assert fp8_kernels.norm_kernel_enabled({}) is False
    assert fp8_kernels.norm_kernel_enabled({fp8_kernels.NORM_KERNEL_ENV: "on"}) is True
    with pytest.raises(ValueError, match=r"JAXLLM_FP8_NORM_KERNEL='yes' must be one of"):
        fp8_kernels.norm_kernel_enabled({fp8_kernels.NORM_KERNEL_ENV: "yes"})


@pytest.mark.parametrize("swiglu", ["off", "f32"])
def test_an_fp8_model_forward_through_the_kernel_matches_xlas_passes(monkeypatch, swiglu):
    # with the SwiGLU kernel too, the MLP's kernel takes the norm's quantized rows
    model = jaxllm.load_model(TINY_QWEN, dtype="float32", quantization="fp8")
    ids = [int(i) for i in np.random.default_rng(1).integers(1, 100, 12)]
    monkeypatch.setenv(fp8_kernels.NORM_KERNEL_ENV, "off")
    monkeypatch.setenv(fp8_kernels.SWIGLU_KERNEL_ENV, "off")
    want = prompt_logits(model, ids)
    monkeypatch.setenv(fp8_kernels.NORM_KERNEL_ENV, "on")
    monkeypatch.setenv(fp8_kernels.SWIGLU_KERNEL_ENV, swiglu)
    traced = []  # the kernel's calls as the forward is traced: both norms of a layer
    kernel = fp8_kernels.rmsnorm_quantize_fp8
    monkeypatch.setattr(fp8_kernels, "rmsnorm_quantize_fp8",
                        lambda *a, **k: traced.append(a[0].shape) or kernel(*a, **k))
    got = prompt_logits(model, ids)
    assert len(traced) >= 2 and set(traced) == {(12, model.config.hidden_size)}
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
