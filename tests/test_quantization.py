"""Quantization: int8 weight-only and FP8 W8A8 (per-output-channel weight scales, quantized
at load time; FP8 also quantizes each token's activations) against float, and the checks that
refuse what jaxllm cannot run before any weight is read (4-bit AWQ/GPTQ checkpoints that do
load: ``test_quant_int4.py``)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMOLLM2_ENGINE_ARGS
from tiny_models import TINY_QWEN, PagedRunner

import jaxllm
from jaxllm.layers import Fp8Weight, Int8Weight, linear, quantize_fp8, quantize_int8
from jaxllm.quantization import compile_options as co
from jaxllm.quantization import resolve_quantization
from jaxllm.quantization.apply import quantize_leaf

HERE = os.path.dirname(__file__)
TEXT = os.path.join(HERE, "fixtures", "text", "pride_and_prejudice_ch1.txt")
# Perplexities are taken over the text's first 256 tokens: a forward of all of it (462)
# takes about twice as long on 2 cores, and the ratios below move by < 0.2 points.
TEXT_TOKENS = 256
# Greedy-token prompts for the quantized SmolLM2 tests (here and test_quant_smollm2.py).
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "The largest planet in the solar system is", "Once upon a time,",
           "1, 2, 3, 4, 5,", "The opposite of hot is", "Shakespeare wrote"]


def test_int8_linear_stays_within_half_a_step_of_float():
    rng = np.random.default_rng(0)
    kernel = rng.normal(size=(64, 48)).astype(np.float32) * rng.uniform(0.1, 3, 48)
    x = rng.normal(size=(5, 64)).astype(np.float32)
    weight = quantize_int8(jnp.asarray(kernel))
    assert weight.q.dtype == jnp.int8 and weight.scale.shape == (48,)
    # Rounding moves each weight by at most half a step (its column's scale), so each output
    # moves by at most sum_k |x_k| * scale_n / 2.
    step = np.asarray(weight.scale)
    assert np.all(np.abs(np.asarray(weight.dequantize()) - kernel) <= step / 2 + 1e-6)
    bound = np.abs(x).sum(axis=1, keepdims=True) * step / 2
    error = np.abs(np.asarray(linear(jnp.asarray(x), weight)) - x @ kernel)
    assert np.all(error <= bound + 1e-4)
    assert error.max() > 0  # it really is quantized


def test_fp8_linear_is_close_to_float():
    rng = np.random.default_rng(1)
    kernel = rng.normal(size=(64, 48)).astype(np.float32) * rng.uniform(0.1, 3, 48)
    x = rng.normal(size=(5, 64)).astype(np.float32) * rng.uniform(0.01, 10, (5, 1))
    weight = quantize_fp8(jnp.asarray(kernel))
    # Stored transposed, [N, K]: the layout the FP8 GEMM reads (linear.py).
    assert weight.qt.dtype == jnp.float8_e4m3fn and weight.qt.shape == (48, 64)
    assert weight.shape == kernel.shape and weight.scale.shape == (48,)
    # e4m3 keeps 3 mantissa bits: each weight within 2^-4 of itself (relative), the scales
    # put every column's largest weight at e4m3's largest value (448).
    dequantized = np.asarray(weight.dequantize())
    assert np.all(np.abs(dequantized - kernel) <= np.abs(kernel) * 2.0**-4 + 1e-6)
    np.testing.assert_allclose(np.abs(np.asarray(weight.qt, np.float32)).max(axis=1), 448)
    ref = x @ kernel
    error = np.linalg.norm(np.asarray(linear(jnp.asarray(x), weight)) - ref, axis=1)
    relative = error / np.linalg.norm(ref, axis=1)  # per token: its own activation scale
    assert np.all(relative < 0.05) and relative.max() > 1e-3, relative


def _perplexity(model, ids) -> float:
    runner = PagedRunner(model.config, model.params, block_size=16,
                         num_blocks=2 + len(ids) // 16)
    logits = runner.run(ids, [len(ids)], list(range(1, 2 + len(ids) // 16)))
    logp = jax.nn.log_softmax(jnp.asarray(logits[:-1]), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), np.asarray(ids[1:])[:, None], axis=1)
    return float(np.exp(nll.mean()))


def test_smollm2_int8_keeps_perplexity_and_greedy_tokens(smollm2):
    """SmolLM2-135M, float32 vs int8 weight-only, on a committed public-domain text (the first
    chapter's opening of Pride and Prejudice, 1813) and on a set of prompts."""
    int8 = smollm2.with_quantization("int8")
    kernel = int8.params["layers"]["attn"]["qkv_proj"]["kernel"]
    assert isinstance(kernel, Int8Weight) and kernel.q.dtype == jnp.int8
    assert int8.params["embed_tokens"]["embedding"].dtype == jnp.float32  # not quantized
    with open(TEXT) as f:
        ids = smollm2.tokenizer(f.read())["input_ids"][:TEXT_TOKENS]
    assert len(ids) == TEXT_TOKENS
    base, quantized = _perplexity(smollm2, ids), _perplexity(int8, ids)
    # Per-channel int8 moves each weight by at most half of 1/127 of its column's largest
    # value; on a model this small that costs well under 2% perplexity (measured: see the
    # assertion message). 3% leaves room for the platform's float differences, not for a
    # broken scale or layout (which cost orders of magnitude).
    assert quantized / base < 1.03, (base, quantized)
    # FP8 W8A8 rounds weights and activations to 3 mantissa bits: 18.75 -> 19.18 (+2.3%)
    # measured on these tokens (the whole text: 16.70 -> 17.06, +2.2%); int8 18.75 -> 18.65.
    fp8 = _perplexity(smollm2.with_quantization("fp8"), ids)
    assert fp8 / base < 1.05, (base, fp8)
    params = jaxllm.SamplingParams(temperature=0, max_tokens=6)
    outs = {}
    for name, model in (("float", smollm2), ("int8", int8)):
        llm = jaxllm.LLM(model, progress=False, **SMOLLM2_ENGINE_ARGS)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params,
                                                                   use_tqdm=False)]
    same = sum(a[:4] == b[:4] for a, b in zip(outs["float"], outs["int8"], strict=True))
    assert same >= 6, (same, outs)


@pytest.mark.parametrize("method, stand_in", [("int8", Int8Weight), ("fp8", Fp8Weight)])
def test_load_time_quantization_through_load_model_and_the_engine_flag(method, stand_in):
    model = jaxllm.load_model(TINY_QWEN, dtype="float32", quantization=method)
    assert model.quantization.method == method
    assert isinstance(model.params["layers"]["mlp"]["down_proj"]["kernel"], stand_in)
    float_model = jaxllm.load_model(TINY_QWEN, dtype="float32")
    same = float_model.with_quantization(method)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(same.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    llm = jaxllm.LLM(TINY_QWEN, quantization=method, max_num_seqs=2, max_model_len=64,
                     enforce_eager=True, compilation_cache_dir=None, progress=False)
    assert llm.engine.model.quantization.method == method
    # FP8 forwards compile with the measured autotune level (CPU accepts and ignores it).
    assert llm.engine.runner._forward_options == (
        {"xla_gpu_autotune_level": co.FP8_AUTOTUNE_LEVEL} if method == "fp8" else {})
    out = llm.generate(prompt_token_ids=[[1, 2, 3]],
                       sampling_params=jaxllm.SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "only 4-bit AWQ"),
    ({"quant_method": "awq", "bits": 4, "group_size": 48}, "group_size=48"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "only the GEMM layout"),
    ({"quant_method": "gptq", "bits": 5, "group_size": 128}, "bits=5"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "'pack-quantized'"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes', which jaxllm does not support"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128},
     "bits=8: jaxllm reads 4-bit GPTQ only"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True},
     "desc_act=true"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "lm_head": True}, "lm_head=true"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False},
     "zero_point=false"),
    # The tiny model's hidden size is 64: groups of 128 rows do not tile it.
    ({"quant_method": "awq", "bits": 4, "group_size": 128},
     "self_attn.q_proj has 64 inputs, which groups of 128"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "modules_to_not_convert": ["mlp"]},
     "modules_to_not_convert names 'mlp'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"},
     "0 config_groups: exactly one"),  # the schemes read: tests/test_quant_fp8_checkpoint.py
])
def test_quantized_checkpoints_are_refused_before_any_weight_is_read(tmp_path, monkeypatch,
                                                                     config, message):
    shutil.copytree(TINY_QWEN, tmp_path / "m")
    with open(tmp_path / "m" / "config.json") as f:
        hf = json.load(f)
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump(hf | {"quantization_config": config}, f)
    import jaxllm.loading.safetensors_io as io

    monkeypatch.setattr(io, "open_checkpoint", lambda *a: pytest.fail("weights were opened"))
    with pytest.raises(ValueError, match=message):
        jaxllm.load_model(str(tmp_path / "m"))


AWQ_CHECKPOINT = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                  "version": "gemm"}


@pytest.mark.parametrize("requested, checkpoint, message", [
    ("int4", None, "--quantization int4: must be one of int8, fp8, awq, gptq, awq_marlin, "
                   "gptq_marlin, compressed-tensors"),
    ("awq", None, "--quantization awq: needs a checkpoint quantized with awq"),
    ("awq_marlin", None, "--quantization awq_marlin: needs a checkpoint quantized with awq"),
    ("fp8", {"quant_method": "fp8"}, "quant_method 'fp8': not supported yet"),
    ("int8", AWQ_CHECKPOINT, "the checkpoint is quantized with awq"),
    ("gptq_marlin", AWQ_CHECKPOINT, "--quantization gptq_marlin: the checkpoint is quantized "
                                    "with awq"),
    ("compressed-tensors", None, "--quantization compressed-tensors: needs a checkpoint in "
                                 "that format \\(the model has no quantization_config\\)"),
    ("compressed-tensors", AWQ_CHECKPOINT, "quantization_config names quant_method 'awq'"),
])
def test_flag_and_checkpoint_must_agree(requested, checkpoint, message):
    with pytest.raises(ValueError, match=message):
        resolve_quantization(requested, checkpoint)
    assert resolve_quantization(None, None) is None


def test_vllm_names_select_the_same_weights():
    """vLLM's Marlin names for AWQ / GPTQ checkpoints (its own upgrade of "awq") and the
    compressed-tensors format's name read the checkpoint as the plain method does; a dummy
    model made under a Marlin name is the plain method's, which keeps it as it is."""
    from tiny_models import TINY

    from jaxllm import ModelConfig
    from jaxllm.loading import load_model

    assert resolve_quantization("awq_marlin", AWQ_CHECKPOINT) == resolve_quantization(
        "awq", AWQ_CHECKPOINT) == resolve_quantization(None, AWQ_CHECKPOINT)
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
            "sym": True}
    assert resolve_quantization("gptq_marlin", gptq) == resolve_quantization(None, gptq)
    model = load_model(load_format="dummy", config=ModelConfig(**TINY), quantization="awq_marlin")
    assert model.quantization.method == "awq" and model.quantization.bits == 4
    assert model.with_quantization("awq_marlin") is model
    assert model.with_quantization("awq") is model


@pytest.mark.parametrize("method", ["int8", "awq"])
def test_dequantized_weights_are_not_all_live_at_once(method):
    """Each layer's weight is widened only once its input exists: the forward's temporaries
    do not grow by a layer's widened weights per layer (before the barrier in ``linear``,
    XLA hoisted every layer's dequantization: 35.6 GiB for Llama-3-70B AWQ on an H200)."""

    from jaxllm.engine.kv_sizing import activation_bytes
    from jaxllm.loading import load_model
    from jaxllm.model_config import ModelConfig

    def temp_bytes(layers: int) -> int:
        cfg = ModelConfig(vocab_size=256, hidden_size=512, intermediate_size=2048,
                          num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=128)
        model = load_model(load_format="dummy", config=cfg, dtype="float32",
                           quantization=method, unroll_layers=True)
        return activation_bytes(model, 64, 8, 4, "reference")

    layer_widened = 4 * 512 * (512 + 2 * 256 + 512 + 3 * 2048)  # f32 bytes of one layer
    assert temp_bytes(3) - temp_bytes(1) < layer_widened


@pytest.mark.parametrize("method", ["int8", "awq"])
def test_the_matmul_reads_its_input_through_the_weights_barrier(method):
    """The barrier that holds a widened weight back until the layer's input exists must pass
    the input on to the matmul: with its x output unused, XLA dropped it where it fused x's
    producer (the RMSNorm) into the GEMM, and the Llama-3-70B AWQ forward compiled for the
    H200 kept 27.8 GiB of widened weights (1.2 GiB with the input read through it;
    benchmarks/step_kernels.py's deviceless compile, RESULTS.md 2026-12-05)."""
    from jaxllm.loading.dummy import dummy_params
    from jaxllm.model_config import ModelConfig
    from jaxllm.quantization.config import dummy_int4_config

    cfg = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=128)
    if method == "awq":
        params = dummy_params(cfg, jnp.bfloat16, quantization=dummy_int4_config("awq", 128))
    else:
        params = dummy_params(cfg, jnp.bfloat16,
                              transform=lambda path, leaf: quantize_leaf(
                                  path, leaf, resolve_quantization("int8", None)))
    weight = jax.tree.map(lambda x: x[0], params["layers"]["mlp"]["down_proj"]["kernel"])
    x = jnp.ones((128, 512), jnp.bfloat16)  # 128 tokens: XLA's path for 4-bit weights too
    jaxpr = jax.make_jaxpr(lambda x, w: linear(x, w, int4_backend="xla"))(x, weight).jaxpr
    [barrier] = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    through = {barrier.outvars[0]}  # x as the barrier passes it on, and what is made of it
    for eqn in jaxpr.eqns:
        if any(v in through for v in eqn.invars if isinstance(v, jax.extend.core.Var)):
            through.update(eqn.outvars)
    assert any(e.primitive.name == "dot_general" and e.invars[0] in through
               for e in jaxpr.eqns)


def test_fp8_mlp_benchmark_times_the_engines_block_and_candidates_that_cost_no_accuracy():
    # benchmarks/fp8_mlp.py: the engine's FP8 MLP block and its candidates (FP8 GEMMs writing
    # bf16; SwiGLU + quantization in one pass, interpreted here), each against the bf16 block
    from jaxllm.benchmarks import fp8_mlp

    result = fp8_mlp.run(fp8_mlp.parse_args(
        ["--tokens", "8", "--hidden", "128", "--intermediate", "256", "--iters", "1"]))
    errors = {row["block"]: row["relative_error"] for row in result["rows"]}
    assert set(errors) == {"bf16", "fp8 (engine)", "fp8 GEMMs out bf16",
                           "fp8 fused, product f32", "fp8 fused, product bf16"}
    assert errors["bf16"] == 0
    # e4m3 keeps 3 mantissa bits: a few percent from bf16; a bf16 output or the kernel's
    # single rounding of silu(gate) up moves that by bf16 roundings (2^-9)
    assert 0.005 < errors["fp8 (engine)"] < 0.1, errors
    for candidate in ("fp8 GEMMs out bf16", "fp8 fused, product f32", "fp8 fused, product bf16"):
        assert abs(errors[candidate] - errors["fp8 (engine)"]) < 0.01, errors
    assert all(row["us"] > 0 for row in result["rows"])


def test_fp8_mlp_picks_the_setting_fastest_at_its_largest_token_count():
    # h200_accept's t1fs runs the offline FP8 run with the setting fp8_mlp's m8 picks
    from jaxllm.benchmarks import fp8_mlp

    def result(times):  # {(tokens, block): us}
        return {"rows": [{"tokens": t, "block": b, "us": us} for (t, b), us in times.items()]}

    times = {(256, "bf16"): 5, (256, "fp8 (engine)"): 9, (256, "fp8 fused, product f32"): 7,
             (256, "fp8 fused, product bf16"): 8, (256, "fp8 GEMMs out bf16"): 1,
             (8192, "bf16"): 50, (8192, "fp8 (engine)"): 40, (8192, "fp8 GEMMs out bf16"): 1,
             (8192, "fp8 fused, product f32"): 36, (8192, "fp8 fused, product bf16"): 33}
    assert fp8_mlp.kernel_setting(result(times)) == "bf16"
    assert fp8_mlp.kernel_setting(result(times | {(8192, "fp8 (engine)"): 30})) == "off"
    assert fp8_mlp.kernel_setting(result(times | {(8192, "fp8 fused, product f32"): 32})) == "f32"
