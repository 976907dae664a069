"""``JAXLLM_ROPE_KV_KERNEL``: RoPE and the K/V write in one kernel (rope_kv_write.py) against
the model's XLA steps, and the model's generation through it (interpreted on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.pallas_kernels.paged_attention import rope_kv_write as rope_kv_module
from jaxllm.pallas_kernels.paged_attention.rope_kv_write import (
    rope_kv_write,
    rope_kv_write_reference,
    unsupported,
)

import jaxllm
from jaxllm import attention
from jaxllm.model_config import ModelConfig


def case(tokens: int, kv_heads: int, group: int, head_dim: int, dtype=jnp.bfloat16,
         layers: int = 2, blocks: int = 6, block_size: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((tokens, kv_heads * (group + 2) * head_dim)), dtype)
    angles = rng.uniform(0, 6, (tokens, head_dim // 2))
    angles = np.concatenate([angles, angles], -1)  # rope_cos_sin's: both halves' angles
    cos, sin = (jnp.asarray(f(angles), jnp.float32) for f in (np.cos, np.sin))
    shape = (layers, blocks, block_size, kv_heads, head_dim)
    k_pool = jnp.asarray(rng.standard_normal(shape), dtype)
    return qkv, cos, sin, k_pool, -k_pool


def f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32))


@pytest.mark.parametrize("tokens,kv_heads,group,head_dim,dtype", [
    (1, 2, 4, 64, jnp.bfloat16), (3, 2, 1, 128, jnp.bfloat16), (2, 1, 3, 16, jnp.float32)])
@pytest.mark.parametrize("layer", [0, 1])
def test_the_kernel_is_the_models_rope_and_kv_write(tokens, kv_heads, group, head_dim, dtype,
                                                     layer):
    qkv, cos, sin, k_pool, v_pool = case(tokens, kv_heads, group, head_dim, dtype)
    slots = jnp.asarray([5, -1, 17][:tokens], jnp.int32)  # a padded token writes nothing
    got = rope_kv_write(qkv, cos, sin, k_pool, v_pool, layer, slots, interpret=True)
    want = rope_kv_write_reference(qkv, cos, sin, k_pool, v_pool, layer, slots)
    assert got[0].shape == (tokens, kv_heads * group, head_dim) and got[0].dtype == dtype
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(f32(a), f32(b))
    changed = np.argwhere(f32(got[1]) != f32(k_pool))[:, :3]  # (layer, block, offset)
    written = {(layer, s // 4, s % 4) for s in np.asarray(slots) if s >= 0}
    assert {tuple(c) for c in changed} == written


@pytest.mark.parametrize("tokens,splits", [(1, 32), (3, 2)])
def test_the_kernel_sums_the_projections_split_partials(tokens, splits):
    """qkv as the 4-bit GEMV's split-K partials f32[S, T, N]: summed in the kernel and rounded
    to the projection's dtype, as XLA's sum then cast before the call (multiples of 2^-8
    below 2^8: exact sums in any order)."""
    _, cos, sin, k_pool, v_pool = case(tokens, 2, 4, 64)
    rng = np.random.default_rng(1)
    parts = jnp.asarray(rng.integers(-2**15, 2**15, (splits, tokens, 2 * 6 * 64)) / 2**8,
                        jnp.float32)
    slots = jnp.asarray([5, -1, 17][:tokens], jnp.int32)
    got = rope_kv_write(parts, cos, sin, k_pool, v_pool, 1, slots, interpret=True,
                        dtype=jnp.bfloat16)
    want = rope_kv_write_reference(parts, cos, sin, k_pool, v_pool, 1, slots,
                                   dtype=jnp.bfloat16)
    summed = rope_kv_write_reference(parts.sum(0).astype(jnp.bfloat16), cos, sin, k_pool,
                                     v_pool, 1, slots)
    assert got[0].dtype == jnp.bfloat16
    for a, b, c in zip(got, want, summed, strict=True):
        np.testing.assert_array_equal(f32(a), f32(b))
        np.testing.assert_array_equal(f32(b), f32(c))
    with pytest.raises(ValueError, match="float32 with the output dtype"):
        rope_kv_write(parts, cos, sin, k_pool, v_pool, 1, slots, interpret=True)


def test_what_the_kernel_does_not_take():
    pool = (1, 8, 16, 8, 128)
    assert unsupported((1, 8 * 6 * 128), pool, jnp.bfloat16, jnp.bfloat16) is None
    assert "float8" in unsupported((1, 8 * 6 * 128), pool, jnp.bfloat16, jnp.float8_e4m3fn)
    assert "power of two" in unsupported((1, 2 * 6 * 96), (1, 8, 16, 2, 96), jnp.bfloat16,
                                         jnp.bfloat16)
    assert "not [T" in unsupported((1, 1000), pool, jnp.bfloat16, jnp.bfloat16)
    qkv, cos, sin, k_pool, v_pool = case(1, 2, 4, 64)
    with pytest.raises(ValueError, match="float8"):
        rope_kv_write(qkv, cos, sin, k_pool.astype(jnp.float8_e4m3fn),
                      v_pool.astype(jnp.float8_e4m3fn), 0, jnp.zeros((1,), jnp.int32),
                      interpret=True)


def test_the_switch_and_where_it_applies(monkeypatch):
    qkv, *_, k_pool, v_pool = case(1, 2, 4, 64)
    pool = attention.KVPool(k=k_pool, v=v_pool)
    monkeypatch.delenv("JAXLLM_ROPE_KV_KERNEL", raising=False)
    assert attention.rope_kv_kernel_applies(qkv, pool, "pallas_interpret", None)  # default
    monkeypatch.setenv("JAXLLM_ROPE_KV_KERNEL", "off")
    assert not attention.rope_kv_kernel_applies(qkv, pool, "pallas_interpret", None)
    monkeypatch.setenv("JAXLLM_ROPE_KV_KERNEL", "on")
    assert not attention.rope_kv_kernel_applies(qkv, pool, "reference", None)
    many = jnp.zeros((attention.ROPE_KV_KERNEL_MAX_TOKENS + 1, qkv.shape[1]), qkv.dtype)
    assert not attention.rope_kv_kernel_applies(many, pool, "pallas_interpret", None)
    monkeypatch.setenv("JAXLLM_ROPE_KV_KERNEL", "1")
    with pytest.raises(ValueError, match="JAXLLM_ROPE_KV_KERNEL='1' must be 'off' or 'on'"):
        attention.rope_kv_kernel_enabled()


CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)


def test_generation_through_the_kernel_keeps_the_tokens(monkeypatch):
    model = jaxllm.load_model(load_format="dummy", config=CFG, dtype="bfloat16")
    calls = []
    kernel = rope_kv_module.rope_kv_write

    def counted(qkv, *args, **kwargs):
        calls.append(qkv.shape[0])
        return kernel(qkv, *args, **kwargs)

    monkeypatch.setattr(attention, "rope_kv_write", counted)

    def greedy(setting: str, params) -> np.ndarray:
        monkeypatch.setenv("JAXLLM_ROPE_KV_KERNEL", setting)
        jax.clear_caches()  # the switch is read as the forward is traced
        out = jaxllm.generate(params, jnp.asarray([[3, 17, 42, 7, 99], [5, 6, 0, 0, 0]]),
                              jnp.asarray([5, 2]), jax.random.key(0), config=CFG,
                              max_new_tokens=6, block_size=4, attention_backend="pallas_interpret")
        jax.clear_caches()
        return np.asarray(out.tokens)

    for params in (model.params, model.with_layer_layout(True).params):  # scanned, unrolled
        calls.clear()
        off = greedy("off", params)
        assert calls == []
        on = greedy("on", params)
        np.testing.assert_array_equal(on, off)
        assert calls  # traced: the prefill's and the decode step's (one a layer unrolled)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")
@pytest.mark.parametrize("tokens", [1, 16])
def test_the_kernel_compiled_is_the_models_rope_and_kv_write(tokens):
    """Compiled, Llama-3-8B's heads (8 KV heads of 4 queries, 128 wide) into one layer's pool
    of 64 pages of 16: each rotated value within a bf16 rounding of XLA's (either may contract
    the products into FMAs), the values and the untouched slots equal."""
    qkv, cos, sin, k_pool, v_pool = case(tokens, 8, 4, 128, layers=1, blocks=64, block_size=16)
    slots = jnp.asarray(np.random.default_rng(1).permutation(1024)[:tokens], jnp.int32)
    slots = slots.at[0].set(-1)
    got = jax.jit(rope_kv_write)(qkv, cos, sin, k_pool, v_pool, 0, slots)
    want = jax.jit(rope_kv_write_reference)(qkv, cos, sin, k_pool, v_pool, 0, slots)
    for a, b in zip(got[:2], want[:2], strict=True):
        np.testing.assert_allclose(f32(a), f32(b), rtol=2.0**-7, atol=2.0**-7)
    np.testing.assert_array_equal(f32(got[2]), f32(want[2]))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")
def test_the_kernel_compiled_sums_split_partials():
    """Compiled, the 8B qkv GEMV's 32 split partials of one token (as the AWQ one-row step
    passes them): exact sums (multiples of 2^-8 below 2^8), so the values equal XLA's sum then
    the reference's; the rotated ones within a bf16 rounding."""
    _, cos, sin, k_pool, v_pool = case(1, 8, 4, 128, layers=1, blocks=64, block_size=16)
    rng = np.random.default_rng(2)
    parts = jnp.asarray(rng.integers(-2**15, 2**15, (32, 1, 8 * 6 * 128)) / 2**8, jnp.float32)
    slots = jnp.asarray([77], jnp.int32)
    got = jax.jit(rope_kv_write, static_argnames="dtype")(parts, cos, sin, k_pool, v_pool, 0,
                                                          slots, dtype=jnp.bfloat16)
    want = jax.jit(rope_kv_write_reference, static_argnames="dtype")(
        parts, cos, sin, k_pool, v_pool, 0, slots, dtype=jnp.bfloat16)
    for a, b in zip(got[:2], want[:2], strict=True):
        np.testing.assert_allclose(f32(a), f32(b), rtol=2.0**-7, atol=2.0**-7)
    np.testing.assert_array_equal(f32(got[2]), f32(want[2]))
