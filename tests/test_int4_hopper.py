"""The Hopper 4-bit matmul (pallas_kernels/quantized_matmul/hopper.py) against its reference:
run by JAX's GPU interpreter on CPU (its warpgroups, TMA pipeline and tiles as written, the
product as a register dot), lowered for an H200 without a GPU, and on a GPU when there is
one."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from deviceless import needs_cuda_plugin
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from jaxllm.pallas_kernels.quantized_matmul import int4_matmul_reference
from jaxllm.pallas_kernels.quantized_matmul.hopper import (
    HopperInt4Config,
    config_for,
    hopper_weight,
    int4_matmul_hopper,
    unsupported,
)
from jaxllm.pallas_kernels.quantized_matmul.reference import unpack_int4


def _case(tokens, k, n, group, seed=0, lead=()):
    rng = np.random.default_rng(seed)
    words = rng.integers(-2**31, 2**31 - 1, (k // 8, n), dtype=np.int64).astype(np.int32)
    scales = rng.uniform(0.01, 0.02, (k // group, n))
    zeros = rng.integers(0, 16, (k // group, n))
    x = rng.normal(size=(*lead, tokens, k))
    return (jnp.asarray(x, jnp.bfloat16), jnp.asarray(words), jnp.asarray(scales, jnp.bfloat16),
            jnp.asarray(zeros, jnp.uint8))


def _check(args, group, config, interpret):
    out = int4_matmul_hopper(*args, group_size=group, interpret=interpret, config=config)
    ref = int4_matmul_reference(*args, group_size=group)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    # the products summed in another order in float32, each output rounded to bf16 once: at
    # most about one bf16 step (2^-7 relative) of the largest output apart
    assert np.abs(out - ref).max() <= 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("tokens,k,n,group,config,lead", [
    # 12 output tiles over the interpreter's 2 programs, two steps a group
    (70, 512, 512, 128, HopperInt4Config(tile_tokens=32, tile_k=64), ()),
    # one token (padded to a tile of 16), one step a group, leading batch axes
    (1, 256, 128, 256, HopperInt4Config(tile_tokens=16), (1,)),
    # groups of 64 over 64-wide steps, tokens past one tile
    (130, 256, 256, 64, HopperInt4Config(tile_tokens=64, tile_k=64), ()),
    # one tile on two programs: K split in two, the float32 partials summed after the call
    (20, 512, 128, 128, HopperInt4Config(tile_tokens=32), ()),
    # four splits of one group each, over four tiles
    (40, 512, 256, 128, HopperInt4Config(tile_tokens=32, num_splits=4), ()),
    # config_for's: a 16-token tile with 8 stages, K of 8 steps (every slot filled once)
    (3, 1024, 128, 128, None, ()),
], ids=["tiles_over_programs", "one_token", "group_64", "split_k_auto", "split_k_4",
        "few_tokens_default"])
def test_interpreted_kernel_equals_reference(tokens, k, n, group, config, lead):
    _check(_case(tokens, k, n, group, seed=tokens, lead=lead), group, config, interpret=True)


def test_weight_is_the_centred_nibbles_n_major():
    _, words, _, _ = _case(1, 256, 128, 128)
    w = hopper_weight(words)
    assert w.dtype == jnp.int4 and w.shape == (128, 256)
    np.testing.assert_array_equal(np.asarray(w, np.int32), np.asarray(unpack_int4(words)).T - 8)


@pytest.mark.parametrize("tokens", [1, 128])
def test_lowers_to_one_mosaic_gpu_kernel_for_the_h200(monkeypatch, tokens):
    """Llama-3-8B's gate_up at 1 and 128 tokens, config_for's configs (shared memory checked
    at lowering), lowered for sm_90a on a machine without a GPU."""
    from jaxllm.pallas_kernels.quantized_matmul import hopper

    monkeypatch.setattr(hopper, "_num_sms", lambda: 132)
    k, n, group = 4096, 28672, 128
    shapes = [((tokens, k), jnp.bfloat16), ((k // 8, n), jnp.int32),
              ((k // group, n), jnp.bfloat16), ((k // group, n), jnp.uint8)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with use_abstract_mesh(h200):
        run = functools.partial(int4_matmul_hopper, group_size=group)
        text = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


@needs_cuda_plugin
def test_the_unrolled_step_lowers_the_kernel_once_a_shape(monkeypatch):
    """The Llama-3-8B AWQ step of 128 tokens under the switch, lowered for an H200 without
    one: 128 calls (4 projections x 32 layers) of 4 Mosaic GPU kernels, one a shape. Before
    the kernel was jitted each call site lowered its own (~0.4 s each: 33 s a step bucket;
    the engine under the switch was not ready in 265 s on an H100; RESULTS.md 2026-12-07)."""
    from jaxllm.benchmarks.step_kernels import deviceless_gpu, step_program

    monkeypatch.setenv("JAXLLM_INT4_HOPPER", "on")
    lowered, _, _ = step_program("llama-3-8b", "awq", "auto", 128, 128, 64, "pallas_mosaic",
                                 deviceless_gpu())
    text = lowered.as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 4
    assert len(re.findall(r"call @int4_matmul_hopper_nk(_\d+)?\b", text)) == 128


def test_refuses_what_it_cannot_take():
    assert unsupported(16, 4096, 4096, 128) is None
    assert "multiple of 128" in unsupported(16, 4096, 4160, 128)
    assert "tile_k=128" in unsupported(16, 4096, 4096, 32)
    args = _case(4, 256, 192, 128)
    with pytest.raises(ValueError, match="N=192 is not a multiple of 128"):
        int4_matmul_hopper(*args, group_size=128, interpret=True)
    with pytest.raises(ValueError, match="tile_tokens=24 must be a multiple of 16"):
        HopperInt4Config(tile_tokens=24)
    with pytest.raises(ValueError, match="tile_k=96 must be a multiple of 64"):
        HopperInt4Config(tile_k=96)
    assert "3 splits of whole groups" in unsupported(16, 4096, 4096, 128,
                                                     HopperInt4Config(num_splits=3))
    # decode at Llama-3-8B's qkv: 48 tiles split to fill 132 programs
    assert HopperInt4Config().splits(48, 4096, 128, 132) == 4
    # config_for: deeper pipelines for the 16-token tile only (the 128-token tile's 4 stages
    # already fill the shared memory)
    assert config_for(1) == config_for(16) == HopperInt4Config(
        tile_tokens=16, max_concurrent_steps=8)
    assert config_for(17).max_concurrent_steps == config_for(500).max_concurrent_steps == 4


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a Hopper GPU")
@pytest.mark.parametrize("tokens", [1, 16, 128, 512])
@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096)], ids=["qkv", "down"])
def test_compiled_kernel_equals_reference_on_gpu(tokens, k, n):
    """Llama-3-8B's qkv and down projections as the kernel would run in the engine."""
    _check(_case(tokens, k, n, 128, seed=tokens), 128, None, interpret=False)


def test_n_major_weights_equal_the_packed_ones_and_run_the_kernel():
    """``JAXLLM_INT4_HOPPER=on``'s weights (Int4WeightNK, made by int4_n_major from one-layer
    packed weights): the same dequantized weight, the same CPU result bit for bit, and the
    Hopper kernel (interpreted) within bf16 rounding."""
    from jaxllm.layers.linear import Int4Weight, Int4WeightNK, int4_n_major, linear

    x, words, scales, zeros = _case(32, 256, 128, 128)
    packed = Int4Weight(words, scales, zeros)
    stacked = Int4Weight(words[None], scales[None], zeros[None])
    converted = int4_n_major({"one": {"kernel": packed}, "stacked": stacked})
    nk = converted["one"]["kernel"]
    assert isinstance(nk, Int4WeightNK) and nk.shape == packed.shape and nk.group_size == 128
    assert converted["stacked"] is stacked  # a stacked layout's weight is left as it is
    np.testing.assert_array_equal(nk.dequantize(), packed.dequantize())
    ref = np.asarray(linear(x, packed), np.float32)
    np.testing.assert_array_equal(np.asarray(linear(x, nk), np.float32), ref)
    out = np.asarray(linear(x, nk, int4_backend="pallas_interpret"), np.float32)
    assert np.abs(out - ref).max() <= 1e-2 * np.abs(ref).max()


def test_n_major_projections_past_the_kernels_tokens_take_xla():
    """Past INT4_HOPPER_MAX_TOKENS an N-major projection is XLA's dequantize and dot, the
    weight contracted on its stored K (no Hopper kernel in the program), with the packed
    weight's products: within a bf16 rounding of its result."""
    from jaxllm.layers.linear import INT4_HOPPER_MAX_TOKENS, Int4Weight, int4_n_major, linear

    tokens = INT4_HOPPER_MAX_TOKENS + 1
    x, words, scales, zeros = _case(tokens, 256, 128, 128, seed=5)
    packed = Int4Weight(words, scales, zeros)
    nk = int4_n_major({"k": packed})["k"]
    run = jax.jit(lambda x: linear(x, nk, int4_backend="pallas_interpret"))
    jaxpr = str(jax.make_jaxpr(run)(x))
    assert "pallas_call" not in jaxpr and "dot_general" in jaxpr
    ref = np.asarray(linear(x, packed), np.float32)
    out = np.asarray(run(x), np.float32)
    assert out.shape == (tokens, 128)
    assert np.abs(out - ref).max() <= 1e-2 * np.abs(ref).max()


def test_both_layouts_send_the_gemv_tokens_to_the_packed_words_and_more_to_the_copy():
    """``JAXLLM_INT4_HOPPER=both``: the packed weight keeps its words (not freed, even when
    donated) with the N-major copy beside them. 1-16 tokens run the packed GEMV, 17 to
    INT4_HOPPER_MAX_TOKENS the Hopper kernel (interpreted) over the copy, more XLA's dequantize
    and dot of the packed words; each within bf16 rounding of the packed weight's CPU result,
    which stays the packed path's. A step reads one layout (``one_layout``: the packed)."""
    from jaxllm.layers.linear import (
        INT4_HOPPER_MAX_TOKENS,
        Int4Weight,
        Int4WeightNK,
        int4_n_major,
        linear,
        one_layout,
    )

    x, words, scales, zeros = _case(INT4_HOPPER_MAX_TOKENS + 1, 256, 128, 128, seed=7)
    packed = Int4Weight(jnp.array(words), scales, zeros)
    both = int4_n_major({"k": packed}, donate=True, keep_packed=True)["k"]
    assert not packed.qweight.is_deleted() and both.qweight is packed.qweight
    assert isinstance(both, Int4Weight) and isinstance(both.n_major, Int4WeightNK)
    np.testing.assert_array_equal(both.n_major.dequantize(), packed.dequantize())
    assert jax.tree.structure(one_layout({"k": both})) == jax.tree.structure({"k": packed})

    for tokens, kernel in ((1, "int4_gemv"), (16, "int4_gemv"), (17, "int4_matmul_hopper_nk"),
                           (INT4_HOPPER_MAX_TOKENS + 1, None)):
        rows = x[:tokens]
        run = jax.jit(lambda rows: linear(rows, both, int4_backend="pallas_interpret"))
        names = set(re.findall(r"name=(\w+)", str(jax.make_jaxpr(run)(rows))))
        kernels = names & {"int4_gemv", "int4_matmul", "int4_matmul_hopper_nk", "int4_gemv_nk"}
        assert kernels == ({kernel} if kernel else set()), (tokens, names)
        if kernel is None:  # the packed words' path: no N-major [N, K] dequantized
            assert "transpose" not in str(jax.make_jaxpr(run)(rows))
        ref = np.asarray(linear(rows, packed), np.float32)
        np.testing.assert_array_equal(np.asarray(linear(rows, both), np.float32), ref)
        out = np.asarray(run(rows), np.float32)
        assert np.abs(out - ref).max() <= 1e-2 * np.abs(ref).max(), tokens


def test_n_major_conversion_frees_owned_packed_words():
    """``int4_n_major(donate=True)`` (the engine's own load): each packed weight is freed as
    its N-major copy is made, so the load never holds the model's 4-bit weights twice; words
    shared by two projections are converted once; without ``donate`` the caller's stay."""
    from jaxllm.layers.linear import Int4Weight, int4_n_major

    _, words, scales, zeros = _case(1, 256, 128, 128)
    expected = Int4Weight(words, scales, zeros).dequantize()
    owned = Int4Weight(jnp.array(words), scales, zeros)
    shared = Int4Weight(owned.qweight, scales, zeros)
    kept = Int4Weight(jnp.array(words), scales, zeros)
    converted = int4_n_major({"a": owned, "b": shared}, donate=True)
    assert owned.qweight.is_deleted()
    assert converted["a"].w is converted["b"].w
    np.testing.assert_array_equal(converted["b"].dequantize(), expected)
    int4_n_major({"c": kept})
    assert not kept.qweight.is_deleted()


def test_engine_stores_n_major_weights_when_asked(monkeypatch):
    """The engine under ``JAXLLM_INT4_HOPPER=on``: a dummy AWQ model's projections stored
    N-major, under "both" packed with the N-major copy beside them, the same greedy tokens as
    without (on CPU all are XLA's path); a bad value, or the stacked layout, refused before
    anything runs."""
    from tiny_models import TINY

    import jaxllm
    from jaxllm import ModelConfig, SamplingParams
    from jaxllm.layers.linear import Int4WeightNK

    model = jaxllm.load_model(load_format="dummy", config=ModelConfig(**TINY),
                              quantization="awq", unroll_layers=True)
    args = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16,
                unroll_layers=True, progress=False)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    tokens = {}
    for setting in ("off", "on", "both"):
        monkeypatch.setenv("JAXLLM_INT4_HOPPER", setting)
        llm = jaxllm.LLM(model, **args)
        kernel = llm.engine.model.params["layers"][0]["mlp"]["down_proj"]["kernel"]
        assert isinstance(kernel, Int4WeightNK) == (setting == "on")
        assert isinstance(getattr(kernel, "n_major", None), Int4WeightNK) == (setting == "both")
        tokens[setting] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], greedy)]
    assert tokens["on"] == tokens["off"] == tokens["both"]
    with pytest.raises(ValueError, match="needs the unrolled layers"):
        model.with_layer_layout(False).with_int4_n_major("on")
    monkeypatch.setenv("JAXLLM_INT4_HOPPER", "yes")
    with pytest.raises(ValueError, match=r"JAXLLM_INT4_HOPPER='yes' must be one of \['auto', "
                                         r"'both', 'off', 'on'\]"):
        jaxllm.LLM(model, **args)
