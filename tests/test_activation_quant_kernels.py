"""The FP8 activation kernels (pallas_kernels/activation_quant) against their references in
Pallas' interpreter, the references against what the model computes before an FP8 projection
(jaxllm.layers.linear, models.llama), and the model through the kernels
(jaxllm.layers.fp8_kernels) against XLA's passes: the one-pass SwiGLU + quantization between
an FP8 MLP's two GEMMs, then the one-pass RMSNorm + quantization before a projection."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.pallas_kernels.activation_quant import (
    rmsnorm_fp8,
    rmsnorm_quantize_fp8,
    rmsnorm_quantize_fp8_reference,
    swiglu_quantize_fp8,
    swiglu_quantize_fp8_reference,
    unsupported,
)
from tiny_models import TINY_QWEN, prompt_logits

import jaxllm
from jaxllm.layers import fp8_kernels, mlp
from jaxllm.layers.fp8 import fp8_product, quantize_fp8, quantize_tokens_fp8
from jaxllm.layers.linear import linear
from jaxllm.models.llama import RMSNorm


def assert_within_one_fp8_step(q, scale, want_q, want_scale):
    """A kernel that rounds once where the reference rounds each bf16 op (or sums in another
    order): each of the reference's roundings moves a value by up to half a bf16 step (2^-9
    relative, 2^-8 at worst where XLA's GPU passes round differently), and SwiGLU's reference
    rounds three times (the scales, silu, the product: a row's scale 1.2% apart on the H200,
    2026-12-05), and XLA's GPU reference a fourth time inside silu (1.25% apart on an H100,
    2026-12-06); that moves an FP8 value (2^-3 apart) by one step at most, and rarely."""
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=4 * 2**-8)
    got, want = np.asarray(q, np.float32), np.asarray(want_q, np.float32)
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0**-6))) - 3)
    assert np.all(np.abs(got - want) <= step), np.abs(got - want).max()
    assert np.mean(got == want) > 0.9


def _gate_up_product(tokens: int, f: int, dtype, seed: int = 0):
    """An FP8 gate_up projection's GEMM, as linear() runs it: (product, x_scale, w_scale)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, 32)) * rng.uniform(0.1, 5, (tokens, 1)), dtype)
    weight = quantize_fp8(jnp.asarray(rng.standard_normal((32, 2 * f)) * 0.2, dtype))
    xq, x_scale = quantize_tokens_fp8(x)
    product = fp8_product(xq, weight, dtype)
    return x, weight, product, x_scale, weight.scale


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_reference_is_what_the_model_computes_between_the_gemms(dtype):
    x, weight, product, x_scale, w_scale = _gate_up_product(6, 40, dtype)
    # the model: gate_up = linear(x, W) in dtype, silu(gate) * up, down's input quantized
    pairs = linear(x, weight).reshape(6, 40, 2)
    want_q, want_scale = quantize_tokens_fp8(nn.silu(pairs[..., 0]) * pairs[..., 1])
    q, scale = swiglu_quantize_fp8_reference(product, x_scale, w_scale, dtype)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))


@pytest.mark.parametrize("tokens, f", [(5, 48), (3, 64), (2, 1), (4, 52), (2, 4096 + 2048)])
def test_interpreted_swiglu_kernel_equals_reference_in_float32(tokens, f):
    _, _, product, x_scale, w_scale = _gate_up_product(tokens, f, jnp.float32, seed=f)
    q, scale = swiglu_quantize_fp8(product, x_scale, w_scale, jnp.float32, interpret=True)
    want_q, want_scale = swiglu_quantize_fp8_reference(product, x_scale, w_scale, jnp.float32)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (tokens, f) and scale.shape == (tokens, 1)
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))


def test_interpreted_swiglu_kernel_is_within_one_fp8_step_of_reference_in_bfloat16():
    # The kernel computes silu(gate) up in float32 and rounds once
    _, _, product, x_scale, w_scale = _gate_up_product(16, 96, jnp.bfloat16, seed=3)
    q, scale = swiglu_quantize_fp8(product, x_scale, w_scale, jnp.bfloat16, interpret=True)
    assert_within_one_fp8_step(q, scale, *swiglu_quantize_fp8_reference(
        product, x_scale, w_scale, jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")
@pytest.mark.parametrize("tokens, f", [(1, 14336), (64, 14336), (2048, 14336), (3, 28672)])
def test_compiled_swiglu_kernel_is_within_one_fp8_step_of_reference_on_the_gpu(tokens, f):
    rng = np.random.default_rng(tokens)  # a bf16 product as the engine's GEMM writes it
    product = jnp.asarray(rng.standard_normal((tokens, 2 * f)) * 40, jnp.bfloat16)
    x_scale = jnp.asarray(rng.uniform(1e-3, 1e-1, (tokens, 1)), jnp.float32)
    w_scale = jnp.asarray(rng.uniform(1e-3, 1e-2, 2 * f), jnp.float32)
    q, scale = swiglu_quantize_fp8(product, x_scale, w_scale, jnp.bfloat16)
    assert_within_one_fp8_step(q, scale, *jax.jit(swiglu_quantize_fp8_reference, static_argnums=3)(
        product, x_scale, w_scale, jnp.bfloat16))


def test_products_the_swiglu_kernel_cannot_take_are_named():
    assert unsupported((4, 64)) is None
    assert "must be [T, 2F]" in unsupported((4, 63))
    assert "must be [T, 2F]" in unsupported((2, 4, 64))
    assert unsupported((1, 2 * 28672)) is None  # Llama-3-70B: 14 chunks of 2,048 pairs
    assert "not held in registers" in unsupported((1, 2 * 2 * 28672))
    assert "not held in registers" in unsupported((1, 2 * 18944))  # 74 chunks of 256
    with pytest.raises(ValueError, match="must be"):
        swiglu_quantize_fp8(jnp.zeros((4, 63)), jnp.ones((4, 1)), jnp.ones(63), jnp.float32,
                            interpret=True)


# The engine's use of the SwiGLU kernel (jaxllm.layers.mlp): JAXLLM_FP8_SWIGLU_KERNEL.

def test_the_swiglu_kernel_setting_is_read_from_the_environment_and_refused_when_unknown():
    setting = fp8_kernels.swiglu_kernel_setting
    assert setting({}, backend="cpu") == "off"  # "auto": interpreted off the GPU
    assert setting({}, backend="gpu") == "bf16"
    env = fp8_kernels.SWIGLU_KERNEL_ENV
    assert setting({env: "auto"}, backend="gpu") == "bf16"
    assert setting({env: " bf16 "}, backend="cpu") == "bf16"
    assert setting({env: "off"}, backend="gpu") == "off"
    with pytest.raises(ValueError, match=r"JAXLLM_FP8_SWIGLU_KERNEL='fp16' must be one of"):
        fp8_kernels.swiglu_kernel_setting({env: "fp16"})


def test_the_swiglu_kernel_runs_only_between_two_fp8_projections():
    gate_up, down = (quantize_fp8(jnp.ones(shape)) for shape in ((8, 32), (16, 8)))
    product_dtype = fp8_kernels.swiglu_product_dtype
    assert product_dtype(gate_up, down, setting="f32") == jnp.float32
    assert product_dtype(gate_up, down, setting="bf16") == jnp.bfloat16
    assert product_dtype(gate_up, down, setting="off") is None
    assert product_dtype(gate_up, jnp.ones((16, 8)), setting="f32") is None
    assert product_dtype(quantize_fp8(jnp.ones((2, 8, 32))), down, setting="f32") is None
    wide = quantize_fp8(jnp.ones((8, 2 * 37)))  # 37 chunks of one pair: XLA's passes
    assert product_dtype(wide, quantize_fp8(jnp.ones((37, 8))), setting="f32") is None


@pytest.mark.parametrize("dtype, product_dtype", [(jnp.float32, jnp.float32),
                                                  (jnp.bfloat16, jnp.float32),
                                                  (jnp.bfloat16, jnp.bfloat16)])
def test_the_mlp_through_the_swiglu_kernel_matches_xlas_passes(dtype, product_dtype):
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


def test_an_fp8_model_forward_through_the_swiglu_kernel_matches_xlas_passes(monkeypatch):
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


# The RMSNorm + quantization kernel (JAXLLM_FP8_NORM_KERNEL).


def _stream(tokens: int, hidden: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)) * rng.uniform(0.1, 5, (tokens, 1))
    weight = 1 + 0.2 * rng.standard_normal(hidden)
    return jnp.asarray(x, dtype), jnp.asarray(weight, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_reference_is_the_models_norm_then_the_projections_quantization(dtype):
    x, weight = _stream(6, 64, dtype)
    normed = RMSNorm(1e-5, dtype).apply({"params": {"scale": weight}}, x)
    want_q, want_scale = quantize_tokens_fp8(normed)
    q, scale = rmsnorm_quantize_fp8_reference(x, weight, 1e-5)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))


@pytest.mark.parametrize("tokens, hidden", [(5, 64), (1, 16), (3, 4096)])
def test_interpreted_norm_kernel_equals_reference_in_float32(tokens, hidden):
    x, weight = _stream(tokens, hidden, jnp.float32, seed=hidden)
    q, scale = rmsnorm_quantize_fp8(x, weight, 1e-6, interpret=True)
    want_q, want_scale = rmsnorm_quantize_fp8_reference(x, weight, 1e-6)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == x.shape and scale.shape == (tokens, 1)
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=1e-6)
    got, want = np.asarray(q, np.float32), np.asarray(want_q, np.float32)
    assert np.mean(got == want) > 0.999, np.mean(got == want)


def test_interpreted_norm_kernel_is_within_one_fp8_step_of_reference_in_bfloat16():
    # The mean of squares is summed in another order than XLA's
    x, weight = _stream(16, 256, jnp.bfloat16, seed=3)
    q, scale = rmsnorm_quantize_fp8(x, weight, 1e-5, interpret=True)
    assert_within_one_fp8_step(q, scale, *rmsnorm_quantize_fp8_reference(x, weight, 1e-5))


def test_rows_the_norm_kernel_cannot_take_are_named():
    assert rmsnorm_fp8.unsupported((4, 4096)) is None
    assert "power of two" in rmsnorm_fp8.unsupported((4, 576))
    assert "power of two" in rmsnorm_fp8.unsupported((4, 32768))
    assert "must be [T, H]" in rmsnorm_fp8.unsupported((2, 4, 64))
    with pytest.raises(ValueError, match="power of two"):
        rmsnorm_quantize_fp8(jnp.zeros((4, 576)), jnp.ones(576), 1e-5, interpret=True)


def test_the_norm_kernel_setting_is_read_from_the_environment_and_refused_when_unknown():
    # "auto" (unset): on a GPU only; the CPU keeps XLA's passes (no interpreted kernel)
    assert fp8_kernels.norm_kernel_enabled({}, backend="gpu") is True
    assert fp8_kernels.norm_kernel_enabled({}, backend="cpu") is False
    assert fp8_kernels.norm_kernel_enabled({fp8_kernels.NORM_KERNEL_ENV: "off"},
                                           backend="gpu") is False
    assert fp8_kernels.norm_kernel_enabled({fp8_kernels.NORM_KERNEL_ENV: "on"}) is True
    with pytest.raises(ValueError, match=r"JAXLLM_FP8_NORM_KERNEL='yes' must be one of"):
        fp8_kernels.norm_kernel_enabled({fp8_kernels.NORM_KERNEL_ENV: "yes"})


@pytest.mark.parametrize("swiglu", ["off", "f32"])
def test_an_fp8_model_forward_through_the_norm_kernel_matches_xlas_passes(monkeypatch, swiglu):
    # with the SwiGLU kernel too, the MLP's kernel takes the norm's quantized rows
    model = jaxllm.load_model(TINY_QWEN, dtype="float32", quantization="fp8")
    ids = [int(i) for i in np.random.default_rng(1).integers(1, 100, 12)]
    monkeypatch.setenv(fp8_kernels.NORM_KERNEL_ENV, "off")
    monkeypatch.setenv(fp8_kernels.SWIGLU_KERNEL_ENV, "off")
    want = prompt_logits(model, ids)
    monkeypatch.setenv(fp8_kernels.NORM_KERNEL_ENV, "on")
    monkeypatch.setenv(fp8_kernels.SWIGLU_KERNEL_ENV, swiglu)
    traced, rows = [], []  # the kernels' calls as the forward is traced: both norms of a
    # layer, and the o projection's input (rows_fp8)
    kernel, rows_kernel = fp8_kernels.rmsnorm_quantize_fp8, fp8_kernels.quantize_rows_fp8_kernel
    monkeypatch.setattr(fp8_kernels, "rmsnorm_quantize_fp8",
                        lambda *a, **k: traced.append(a[0].shape) or kernel(*a, **k))
    monkeypatch.setattr(fp8_kernels, "quantize_rows_fp8_kernel",
                        lambda *a, **k: rows.append(a[0].shape) or rows_kernel(*a, **k))
    got = prompt_logits(model, ids)
    assert len(traced) >= 2 and set(traced) == {(12, model.config.hidden_size)}
    assert len(rows) == len(traced) // 2 and set(rows) == {(12, model.config.q_size)}
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
