"""The per-token FP8 quantization kernel (pallas_kernels/activation_quant/rows_fp8.py, the o
projection's input under ``JAXLLM_FP8_NORM_KERNEL=on``): equal to its reference bit for bit
(interpreted on CPU, compiled on a GPU), the shapes it refuses named, its Triton lowering for
the H200, and where the model takes it (jaxllm.layers.fp8_kernels.quantized_input)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from jaxllm.pallas_kernels.activation_quant import (
    quantize_rows_fp8,
    quantize_rows_fp8_kernel,
    rows_fp8,
)

from jaxllm.layers import fp8_kernels
from jaxllm.layers.fp8 import Fp8Activation, quantize_fp8


def _rows(tokens: int, k: int, dtype, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((tokens, k)) * rng.uniform(0.01, 300, (tokens, 1))
    h[0] = 0  # an all-zero row: scale 1
    return jnp.asarray(h, dtype)


@pytest.mark.parametrize("tokens,k", [(5, 64), (1, 16), (3, 4096)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_interpreted_kernel_equals_reference(tokens, k, dtype):
    h = _rows(tokens, k, dtype, seed=k)
    q, scale = quantize_rows_fp8_kernel(h, interpret=True)
    want_q, want_scale = quantize_rows_fp8(h)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == h.shape and scale.shape == (tokens, 1)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))


def test_rows_it_cannot_take_are_named():
    assert rows_fp8.unsupported((4, 4096)) is None
    assert "power of two" in rows_fp8.unsupported((4, 576))
    assert "must be [T, H]" in rows_fp8.unsupported((2, 4, 64))
    with pytest.raises(ValueError, match="power of two"):
        quantize_rows_fp8_kernel(jnp.zeros((4, 576)), interpret=True)


def test_the_model_takes_it_only_before_an_fp8_projection_on_one_device_when_picked():
    h = _rows(4, 64, jnp.float32, seed=1)
    fp8 = quantize_fp8(jnp.ones((64, 32)))
    assert fp8_kernels.quantized_input(h, fp8, enabled=False) is h
    assert fp8_kernels.quantized_input(h, jnp.ones((64, 32)), enabled=True) is h  # bf16 weight
    assert not isinstance(fp8_kernels.quantized_input(  # a row it cannot take
        h[:, :48], quantize_fp8(jnp.ones((48, 32))), enabled=True), Fp8Activation)
    got = fp8_kernels.quantized_input(h, fp8, enabled=True)
    assert isinstance(got, Fp8Activation) and got.dtype == h.dtype
    want_q, want_scale = quantize_rows_fp8(h)
    np.testing.assert_array_equal(np.asarray(got.q, np.float32), np.asarray(want_q, np.float32))
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want_scale))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("tokens,k", [(1, 4096), (64, 4096), (8192, 8192)])
def test_lowers_to_triton_for_the_h200(tokens, k):
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    fn = jax.jit(lambda h: quantize_rows_fp8_kernel(h))
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
        text = fn.trace(jax.ShapeDtypeStruct((tokens, k), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "quantize_rows_fp8" in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")
@pytest.mark.parametrize("tokens,k", [(1, 4096), (64, 4096), (2048, 8192)])
def test_compiled_equals_reference_on_the_gpu(tokens, k):
    h = _rows(tokens, k, jnp.bfloat16, seed=tokens)
    q, scale = quantize_rows_fp8_kernel(h)
    want_q, want_scale = jax.jit(quantize_rows_fp8)(h)
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=1e-6)
    got, want = np.asarray(q, np.float32), np.asarray(want_q, np.float32)
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0**-6))) - 3)
    assert np.all(np.abs(got - want) <= step) and np.mean(got == want) > 0.99
