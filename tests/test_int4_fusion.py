"""``JAXLLM_INT4_FUSION``: the (add +) RMSNorm + GEMV-input kernel (gemv_prescale.py), the GEMV
over pre-scaled x, and the model's decode step through them, in the interpreter against the
unfused path."""

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.pallas_kernels.activation_quant.reference import rmsnorm_reference
from jaxllm.pallas_kernels.quantized_matmul.gemv import (
    Int4GemvConfig,
    gemv_config,
    int4_gemv,
    int4_gemv_prescaled,
    prescale_layout,
    xla_summed_splits,
)
from jaxllm.pallas_kernels.quantized_matmul.gemv_denormal import prescaled_inputs
from jaxllm.pallas_kernels.quantized_matmul.gemv_prescale import (
    add_rmsnorm_prescale,
    add_rmsnorm_prescale_reference,
    merge_prescale,
    merge_prescale_reference,
    rmsnorm_prescale,
    rmsnorm_prescale_reference,
    unsupported,
)
from jaxllm.pallas_kernels.quantized_matmul.reference import int4_matmul_reference

import jaxllm
from jaxllm.layers import int4_fusion
from jaxllm.layers.int4_fusion import Int4Activation, norm_prescale_layout
from jaxllm.layers.linear import Int4Weight, linear
from jaxllm.model_config import ModelConfig
from jaxllm.models import llama

linear_module = importlib.import_module("jaxllm.layers.linear")  # the package exports the
# function under the module's name
K, N, GROUP = 512, 384, 128
BF16_ULP = 2.0**-7  # relative: one rounding of the normalized row either way


def weight(k: int = K, n: int = N, seed: int = 0) -> Int4Weight:
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (k, n)).astype(np.uint32)
    words = sum(q[j::8] << (4 * j) for j in range(8)).astype(np.uint32).view(np.int32)
    scales = rng.uniform(0.002, 0.02, (k // GROUP, n)).astype(np.float32)
    zeros = rng.integers(0, 16, (k // GROUP, n)).astype(np.uint8)
    return Int4Weight(jnp.asarray(words), jnp.asarray(scales, jnp.bfloat16), jnp.asarray(zeros))


def rows(shape, seed: int = 1, dtype=jnp.bfloat16) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32))


def assert_prescaled_close(got, want, tokens: int, step_words: int):
    """The norm kernel's (xs, xsum) against the reference's: the statistic's sum runs in
    another order, and XLA may keep the normalized row in float32 (excess precision), so a
    value may round the other way (one bf16 step), and each step's sum by as much."""
    np.testing.assert_allclose(f32(got[0]), f32(want[0]), rtol=BF16_ULP, atol=0)
    # (interpreted, xs is h 2^-64 throughout)
    bound = BF16_ULP * np.abs(f32(want[0])).reshape(tokens, -1, 8 * step_words).sum(-1)
    assert np.all(np.abs(f32(got[1]) - f32(want[1])) <= bound * 1.01)


@pytest.mark.parametrize("tokens,hidden,step_words,pairs", [
    (1, 512, 16, True), (3, 256, 8, True), (2, 1024, 16, False), (1, 128, 1, False)])
def test_rmsnorm_prescale_is_the_norm_then_the_gemv_inputs(tokens, hidden, step_words, pairs):
    x = rows((tokens, hidden)) * 3.0
    delta = rows((tokens, hidden), seed=3)
    w = (1.0 + 0.1 * rows((hidden,), seed=2, dtype=jnp.float32)).astype(jnp.bfloat16)
    common = dict(step_words=step_words, pairs=pairs, interpret=True)
    got = rmsnorm_prescale(x, w, 1e-5, **common)
    assert got[0].shape == (tokens, hidden // 8, 8)
    assert got[1].shape == (tokens, hidden // 8 // step_words)
    assert_prescaled_close(got, rmsnorm_prescale_reference(x, w, 1e-5, **common), tokens,
                           step_words)
    stream, *got = add_rmsnorm_prescale(x, delta, w, 1e-5, **common)
    want_stream, *want = add_rmsnorm_prescale_reference(x, delta, w, 1e-5, **common)
    np.testing.assert_array_equal(f32(stream), f32(want_stream))  # one rounding of the add
    assert stream.dtype == x.dtype
    assert_prescaled_close(got, want, tokens, step_words)


@pytest.mark.parametrize("pairs", [True, False])
def test_merge_prescale_is_the_decode_merge_then_the_gemv_inputs(pairs):
    rng = np.random.default_rng(4)
    o = jnp.asarray(rng.standard_normal((2, 4, 3, 128)), jnp.float32)
    lse = jnp.asarray(rng.standard_normal((2, 4, 3)) * 4, jnp.float32)
    lse = lse.at[0, 1].set(-jnp.inf).at[1, :, 2].set(-jnp.inf)  # an empty split, head
    got = merge_prescale(o, lse, dtype=jnp.bfloat16, pairs=pairs, interpret=True)
    want = merge_prescale_reference(o, lse, dtype=jnp.bfloat16, pairs=pairs, interpret=True)
    assert got[0].shape == (2, 3 * 16, 8) and got[1].shape == (2, 3)
    assert_prescaled_close(got, want, 2, 16)
    assert not np.any(f32(got[0]).reshape(2, 3, 128)[1, 2])  # no keys: zeros
    with pytest.raises(ValueError, match="powers of two"):
        merge_prescale(o[:, :3], lse[:, :3], dtype=jnp.bfloat16, pairs=pairs)


def test_rmsnorm_prescale_refuses_rows_it_cannot_hold():
    assert unsupported((1, 576), 16) is not None  # SmolLM2's width: not a power of two
    assert "steps" in unsupported((1, 64), 16)
    assert unsupported((2, 4096), 16) is None
    with pytest.raises(ValueError, match="power of two"):
        rmsnorm_prescale(rows((1, 576)), rows((576,)), 1e-5, step_words=16, pairs=True)


CONFIGS = {
    "one split": Int4GemvConfig(block_n=128, num_warps=2, num_splits=1),
    "xla sums": Int4GemvConfig(block_n=128, num_warps=2, num_splits=2),
    "last split sums": Int4GemvConfig(block_n=128, num_warps=2, num_splits=2, splits_sum="last"),
    "partial column block": Int4GemvConfig(block_n=256, num_warps=2, num_splits=2,
                                           splits_sum="last"),
    "2^23 loop": Int4GemvConfig(block_n=128, num_splits=1, denormal=False),
    "dot": Int4GemvConfig(dot=True),
}


@pytest.mark.parametrize("name", ["one split", "last split sums", "xla sums"])
def test_the_gemv_over_prescaled_x_is_the_gemv(name):
    w, config = weight(), CONFIGS[name]
    x = rows((2, K))
    step_words, pairs = prescale_layout(config, K, GROUP)
    xs, xsum = prescaled_inputs(x.reshape(2, K // 8, 8), step_words, pairs, True)
    got = int4_gemv_prescaled(xs, xsum, w.qweight, w.scales, w.zeros, dtype=x.dtype,
                              pairs=pairs, group_size=GROUP, interpret=True, config=config)
    want = int4_gemv(x, w.qweight, w.scales, w.zeros, group_size=GROUP, interpret=True,
                     config=config)
    np.testing.assert_array_equal(f32(got), f32(want))
    with pytest.raises(ValueError, match="pre-scaled x in steps of 16"):
        int4_gemv_prescaled(xs, xsum, w.qweight, w.scales, w.zeros, dtype=x.dtype,
                            pairs=not pairs, group_size=GROUP, interpret=True, config=config)
    assert prescale_layout(CONFIGS["dot"], K, GROUP) is None  # reads x as it is
    assert prescale_layout(Int4GemvConfig(x_in_kernel=True), K, GROUP) is None


def test_the_gemvs_split_partials_sum_to_its_result():
    """partials=True: the f32 [splits, T, N] XLA would sum, for a kernel after the call to add;
    counted by xla_summed_splits, refused where the kernel writes the result itself."""
    w, config = weight(), CONFIGS["xla sums"]
    x = rows((2, K))
    step_words, pairs = prescale_layout(config, K, GROUP)
    xs, xsum = prescaled_inputs(x.reshape(2, K // 8, 8), step_words, pairs, True)
    call = functools.partial(int4_gemv_prescaled, xs, xsum, w.qweight, w.scales, w.zeros,
                             dtype=x.dtype, pairs=pairs, group_size=GROUP, interpret=True)
    parts = call(config=config, partials=True)
    assert parts.shape == (2, 2, N) and parts.dtype == jnp.float32
    np.testing.assert_array_equal(f32(parts.sum(0).astype(x.dtype)), f32(call(config=config)))
    assert xla_summed_splits(config, K, N, GROUP) == 2
    for name in ("one split", "last split sums"):
        assert xla_summed_splits(CONFIGS[name], K, N, GROUP) == 0
        with pytest.raises(ValueError, match="leaves no split partials"):
            call(config=CONFIGS[name], partials=True)
    # a partial last column block (N = 384 over 256 columns) leaves wider partials: none
    wide = dataclasses.replace(CONFIGS["partial column block"], splits_sum="xla")
    assert xla_summed_splits(wide, K, N, GROUP) == 0


def test_the_switch_is_read_with_a_clear_error(monkeypatch):
    monkeypatch.delenv("JAXLLM_INT4_FUSION", raising=False)
    assert int4_fusion.fusion_enabled()  # on by default
    monkeypatch.setenv("JAXLLM_INT4_FUSION", "off")
    assert not int4_fusion.fusion_enabled()
    monkeypatch.setenv("JAXLLM_INT4_FUSION", "yes")
    with pytest.raises(ValueError, match="JAXLLM_INT4_FUSION='yes' must be 'off' or 'on'"):
        int4_fusion.fusion_enabled()


def test_prescaled_activations_go_only_to_a_4bit_gemv():
    w = weight()
    layout = norm_prescale_layout(rows((1, K)), w, uses_gemv=True, enabled=True)
    assert layout == prescale_layout(gemv_config(1, K, N, GROUP), K, GROUP)
    assert norm_prescale_layout(rows((1, K)), w, uses_gemv=False, enabled=True) is None
    assert norm_prescale_layout(rows((1, K)), w, uses_gemv=True, enabled=False) is None
    norm_w = jnp.ones((K,), jnp.bfloat16)
    x = int4_fusion.rmsnorm_prescaled(rows((1, K)), norm_w, 1e-5, layout, interpret=True)
    assert isinstance(x, Int4Activation) and x.shape == (1, K)
    stream, x = int4_fusion.rmsnorm_prescaled(rows((1, K)), norm_w, 1e-5, layout,
                                              interpret=True, delta=rows((1, K), seed=9))
    assert stream.shape == (1, K) and isinstance(x, Int4Activation)
    # linear takes it to the GEMV: the GEMV of the normed row, to its rounding
    got = linear(x, w, int4_backend="pallas_interpret")
    normed = rmsnorm_reference(stream, norm_w, 1e-5)
    want = int4_gemv(normed, w.qweight, w.scales, w.zeros, group_size=GROUP, interpret=True)
    np.testing.assert_allclose(f32(got), f32(want), rtol=2 * BF16_ULP, atol=2 * BF16_ULP)
    with pytest.raises(TypeError, match="pre-scaled activations need a 4-bit weight"):
        linear(x, jnp.ones((K, N), jnp.bfloat16), int4_backend="pallas_interpret")


# heads of 128: the o projection's GEMV steps (16 word rows) are one head each
CFG = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)


def greedy(params, monkeypatch, fusion: str) -> tuple[np.ndarray, dict]:
    """8 greedy tokens through the 4-bit kernels (interpreted), and the fused kernels' calls
    as the forward was traced (prefill, then a decode step of one row)."""
    interpreted = lambda backend: "pallas_interpret" if backend == "auto" else backend
    monkeypatch.setattr(linear_module, "resolve_int4_backend", interpreted)
    monkeypatch.setattr(llama, "resolve_int4_backend", interpreted)
    monkeypatch.setenv("JAXLLM_INT4_FUSION", fusion)
    calls = {"norm": [], "add_norm": [], "merge": [], "gemv": [], "partials": []}

    def spy(name, fn):
        def counted(*args, **kwargs):
            calls[name].append(args[0].shape)
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(int4_fusion, "rmsnorm_prescale",
                        spy("norm", int4_fusion.rmsnorm_prescale))
    monkeypatch.setattr(int4_fusion, "add_rmsnorm_prescale",
                        spy("add_norm", int4_fusion.add_rmsnorm_prescale))
    monkeypatch.setattr(int4_fusion, "merge_prescale", spy("merge", int4_fusion.merge_prescale))
    monkeypatch.setattr(linear_module, "prescaled_gemv",
                        spy("gemv", linear_module.prescaled_gemv))
    monkeypatch.setattr(llama, "prescaled_gemv", spy("partials", llama.prescaled_gemv))
    jax.clear_caches()  # the switch is read as the forward is traced
    # padded to 124: 17 pages of 8 a sequence, which the decode kernel splits in two (its
    # blocks of 64 keys)
    ids = jnp.asarray([[3, 17, 42, 7, 99] + [0] * 119], jnp.int32)
    out = jaxllm.generate(params, ids, jnp.asarray([5]), jax.random.key(0), config=CFG,
                          max_new_tokens=8, block_size=8, attention_backend="pallas_interpret")
    jax.clear_caches()
    monkeypatch.undo()
    return np.asarray(out.tokens), calls


def test_the_decode_step_through_the_fused_kernels_keeps_the_greedy_tokens(monkeypatch):
    model = jaxllm.load_model(load_format="dummy", config=CFG, quantization="awq",
                              dtype="bfloat16").with_layer_layout(True)
    assert model.quantization.group_size == 128
    unfused, none = greedy(model.params, monkeypatch, "off")
    assert none == {"norm": [], "add_norm": [], "merge": [], "gemv": [], "partials": []}
    fused, calls = greedy(model.params, monkeypatch, "on")
    np.testing.assert_array_equal(fused, unfused)
    layers, hidden = CFG.num_hidden_layers, CFG.hidden_size
    # the decode step (one row): the first norm has no block before it; every other adds one
    # (the layer's attention, or the MLP of the layer before); qkv and gate_up read them, and
    # o the attention's merged splits; qkv's split partials go unsummed to the RoPE + KV-write
    # kernel (K = 256: 2 splits of 16 word rows)
    assert calls["norm"] == [(1, hidden)]
    assert calls["add_norm"] == [(1, hidden)] * (2 * layers - 1)
    assert calls["merge"] == [(1, 2, CFG.num_attention_heads, CFG.head_dim)] * layers
    assert calls["gemv"] == [(1, hidden)] * (2 * layers)
    assert calls["partials"] == [(1, hidden)] * layers


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernels need a GPU")
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672)])
def test_the_fused_kernels_compiled_equal_the_unfused_path(k, n):
    """Compiled: the add + norm kernel's pre-scaled x into the GEMV on the table's config, at
    the 8B projections after a norm, against XLA's add and norm and the reference product."""
    w = weight(k, n, seed=k + n)
    x, delta = rows((1, k)) * 2.0, rows((1, k), seed=6)
    norm_w = (1.0 + 0.1 * rows((k,), seed=7, dtype=jnp.float32)).astype(jnp.bfloat16)
    layout = prescale_layout(gemv_config(1, k, n, GROUP), k, GROUP)
    stream, xs, xsum = jax.jit(lambda x, d: add_rmsnorm_prescale(
        x, d, norm_w, 1e-5, step_words=layout[0], pairs=layout[1]))(x, delta)
    got = int4_gemv_prescaled(xs, xsum, w.qweight, w.scales, w.zeros, dtype=x.dtype,
                              pairs=layout[1], group_size=GROUP)
    np.testing.assert_array_equal(f32(stream), f32(x + delta))
    h = rmsnorm_reference(stream, norm_w, 1e-5)
    want = f32(int4_matmul_reference(h, w.qweight, w.scales, w.zeros, group_size=GROUP))
    # a normalized value may round the other way: each moves the product by <= 2^-7 |h w|;
    # then both round to bf16 and sum k products in other orders
    bound = BF16_ULP * np.abs(f32(h)) @ np.abs(f32(w.dequantize()))
    sums = 2 * k * 2.0**-24 * (np.abs(f32(h)) @ np.abs(f32(w.dequantize())))
    assert np.all(np.abs(f32(got) - want) <= bound + 2 * BF16_ULP * np.abs(want) + sums)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernels need a GPU")
def test_merge_prescale_compiled_is_the_decode_merge_then_the_gemv_inputs():
    """Compiled, at the 8B decode step's splits (16 of 32 heads of 128), against XLA's merge
    and prescale: each value within a bf16 rounding (exp2 and the sums in other orders)."""
    rng = np.random.default_rng(5)
    o = jnp.asarray(rng.standard_normal((1, 16, 32, 128)), jnp.float32)
    lse = jnp.asarray(rng.standard_normal((1, 16, 32)) * 4, jnp.float32).at[0, 3].set(-jnp.inf)
    got = jax.jit(lambda o, lse: merge_prescale(o, lse, dtype=jnp.bfloat16, pairs=True))(o, lse)
    want = jax.jit(lambda o, lse: merge_prescale_reference(o, lse, dtype=jnp.bfloat16,
                                                           pairs=True))(o, lse)
    np.testing.assert_allclose(f32(got[0]), f32(want[0]), rtol=BF16_ULP, atol=0)
    bound = BF16_ULP * np.abs(f32(want[0])).reshape(1, 32, 128).sum(-1)
    assert np.all(np.abs(f32(got[1]) - f32(want[1])) <= bound * 1.01 + 1e-30)
