"""4-bit AWQ and GPTQ checkpoints: the packed weights jaxllm reads dequantize to exactly what
AutoAWQ's and GPTQModel's own functions give (fixtures from
``tests/reference/make_quant_fixtures.py``), any block of them reads as the whole does (the
tensor-parallel path), and tiny checkpoints load and run through ``load_model`` and ``LLM``."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference.make_awq_smollm2 import quantize_checkpoint, write_checkpoint
from safetensors.numpy import load_file, save_file
from test_convert import assert_converts_bit_for_bit
from tiny_models import TINY_QWEN

import jaxllm
from jaxllm.errors import ModelLoadError
from jaxllm.layers.linear import Int4Weight, linear
from jaxllm.quantization import resolve_quantization
from jaxllm.quantization.int4_checkpoint import Int4Linear

HERE = os.path.dirname(__file__)
CASES = os.path.join(HERE, "fixtures", "quant", "int4_cases.npz")
PREFIX = "model.layers.0.mlp.down_proj"
CASE_NAMES = ("awq_g32", "awq_g128", "gptq_v1_g32", "gptq_v2_g64", "gptq_sym_g32",
              "gptq_v1_channel")


def fixture_case(name: str):
    with np.load(CASES) as data:
        config = json.loads(bytes(data[f"{name}/config"]).decode())
        tensors = {f"{PREFIX}.{part}": data[f"{name}/{part}"]
                   for part in ("qweight", "qzeros", "scales", "g_idx")
                   if f"{name}/{part}" in data}
        return config, tensors, data[f"{name}/reference"], data["x"]


def read_weight(source: Int4Linear, n: int, rows: range | None = None,
                cols: np.ndarray | None = None) -> Int4Weight:
    """The Int4Weight of ``source``'s block: word rows x columns (default: all)."""
    words = rows or range(source.k // 8)
    cols = np.arange(n) if cols is None else cols
    groups = range(words.start * 8 // source.group, words.stop * 8 // source.group)
    return Int4Weight(qweight=jnp.asarray(source.packed(words, cols)),
                      scales=jnp.asarray(source.scales(groups, cols).astype(np.float32)),
                      zeros=jnp.asarray(source.zeros(groups, cols)))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_dequantized_weights_equal_the_reference_libraries(name):
    config, tensors, reference, x = fixture_case(name)
    quant = resolve_quantization(None, config)
    k, n = reference.shape
    source = Int4Linear(PREFIX, k, quant, tensors.__getitem__)
    weight = read_weight(source, n)
    assert weight.qweight.dtype == jnp.int32 and weight.shape == (k, n)
    dequantized = np.asarray(weight.dequantize(jnp.float32))
    # The libraries compute (q - z) * s in fp16 (or round float32 to fp16): one rounding of
    # an exact product, so jaxllm's exact float32 value rounds to the same fp16, bit for bit.
    np.testing.assert_array_equal(dequantized.astype(np.float16), reference)
    y = np.asarray(linear(jnp.asarray(x), weight))
    np.testing.assert_allclose(y, x @ dequantized, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["awq_g32", "gptq_v1_g32"])
def test_any_block_reads_as_the_whole(name):
    """Tensor parallelism reads each device's block straight from the packed tensors: rows
    on group boundaries, any columns (the fused projections' column orders)."""
    config, tensors, reference, _ = fixture_case(name)
    quant = resolve_quantization(None, config)
    k, n = reference.shape
    source = Int4Linear(PREFIX, k, quant, tensors.__getitem__)
    cols = np.random.default_rng(3).permutation(n)[:20]
    block = read_weight(source, n, range(4, 12), cols)  # rows 32..95: groups 1 and 2
    whole = np.asarray(read_weight(source, n).dequantize())
    np.testing.assert_array_equal(np.asarray(block.dequantize()), whole[32:96][:, cols])


def write_tiny(tmp_path, method: str, group: int = 32, **overrides) -> str:
    with open(os.path.join(TINY_QWEN, "config.json")) as f:
        hf = json.load(f)
    tensors = load_file(os.path.join(TINY_QWEN, "model.safetensors"))
    out = str(tmp_path / f"{method}_g{group}")
    write_checkpoint(out, hf, quantize_checkpoint(tensors, method, group,
                                                  float_dtype=np.float32), method, group)
    if overrides:
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] |= overrides
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f)
    return out


def test_tiny_awq_and_gptq_checkpoints_load_packed_and_run(tmp_path):
    float_model = jaxllm.load_model(TINY_QWEN, dtype="float32")
    models = {m: jaxllm.load_model(write_tiny(tmp_path, m), dtype="float32")
              for m in ("awq", "gptq")}
    for method, model in models.items():
        assert model.quantization.method == method and model.quantization.group_size == 32
        layers = model.params["layers"]
        for kernel in (layers["attn"]["qkv_proj"]["kernel"], layers["mlp"]["down_proj"]["kernel"]):
            assert isinstance(kernel, Int4Weight) and kernel.qweight.dtype == jnp.int32
        # No float copy of a projection in the layers: float leaves are norms, biases and
        # the per-group scales.
        floats = {str(path[-1]) for path, leaf in jax.tree_util.tree_flatten_with_path(layers)[0]
                  if leaf.dtype == jnp.float32}
        assert floats == {"['scale']", "['bias']", ".scales"}, floats
    awq, gptq = (models[m].params["layers"] for m in ("awq", "gptq"))
    for path in (("attn", "qkv_proj"), ("attn", "o_proj"), ("mlp", "gate_up_proj"),
                 ("mlp", "down_proj")):
        a, g = (p[path[0]][path[1]]["kernel"] for p in (awq, gptq))
        # One RTN quantization packed two ways: the same weight once read.
        np.testing.assert_array_equal(np.asarray(a.dequantize()), np.asarray(g.dequantize()))
        kernel = np.asarray(float_model.params["layers"][path[0]][path[1]]["kernel"])
        step = np.repeat(np.asarray(a.scales), kernel.shape[-2] // a.scales.shape[-2], axis=-2)
        assert np.all(np.abs(np.asarray(a.dequantize()) - kernel) <= step / 2 + 1e-6)
    # The unrolled layer stack (GPU's default) reads the same packed leaves per layer.
    unrolled = jaxllm.load_model(write_tiny(tmp_path, "awq"), dtype="float32",
                                 unroll_layers=True)
    down = unrolled.params["layers"][1]["mlp"]["down_proj"]["kernel"]
    assert isinstance(down, Int4Weight)
    np.testing.assert_array_equal(np.asarray(down.qweight),
                                  np.asarray(awq["mlp"]["down_proj"]["kernel"].qweight[1]))
    llm = jaxllm.LLM(write_tiny(tmp_path, "awq"), quantization="awq", max_num_seqs=2,
                     max_model_len=64, enforce_eager=True, compilation_cache_dir=None,
                     progress=False)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]],
                       sampling_params=jaxllm.SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="--quantization gptq: the checkpoint is quantized "
                                         "with awq"):
        jaxllm.load_model(write_tiny(tmp_path, "awq"), quantization="gptq")


def test_act_order_g_idx_is_refused_when_read(tmp_path):
    """desc_act=true with static groups passes the config check; a g_idx that is not k // g
    (act-order) is refused as soon as it is read."""
    path = write_tiny(tmp_path, "gptq", desc_act=True, static_groups=True)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.g_idx"
    tensors[name] = tensors[name][::-1].copy()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"o_proj.g_idx is not k // 32 \(act-order"):
        jaxllm.load_model(path, dtype="float32")


def test_legacy_autoawq_quant_config_json_is_read_with_the_flag(tmp_path):
    """Older AutoAWQ checkpoints keep their settings in quant_config.json (w_bit,
    q_group_size, version "GEMM"); vLLM reads it when --quantization awq is given."""
    path = write_tiny(tmp_path, "awq")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "quant_config.json"), "w") as f:
        json.dump({"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}, f)
    model = jaxllm.load_model(path, dtype="float32", quantization="awq")
    assert model.quantization.describe() == "awq (4-bit, group size 32, checkpoint)"
    with pytest.raises(ValueError, match="--quantization gptq: the checkpoint is quantized "
                                         "with awq"):
        with open(os.path.join(path, "quantize_config.json"), "w") as f:
            json.dump({"quant_method": "awq", "bits": 4, "group_size": 32}, f)
        jaxllm.load_model(path, quantization="gptq")


@pytest.mark.parametrize("method, group", [("awq", 32), ("gptq", -1)])
def test_convert_keeps_a_4bit_checkpoint_packed(tmp_path, method, group):
    """``jaxllm convert`` of a 4-bit checkpoint: the same packed words, scales and zero points
    (one group per row included), bit for bit, in either layer layout."""
    converted = assert_converts_bit_for_bit(write_tiny(tmp_path, method, group), tmp_path)
    for unroll, model in converted.items():
        layers = model.params["layers"][0] if unroll else model.params["layers"]
        assert isinstance(layers["mlp"]["down_proj"]["kernel"], Int4Weight)
    # vLLM's Marlin name for the method agrees with the converted checkpoint, the other refused
    out = str(tmp_path / "converted")
    assert jaxllm.load_model(out, quantization=f"{method}_marlin").quantization == \
        converted[False].quantization
    other = "gptq" if method == "awq" else "awq"
    with pytest.raises(ValueError, match=f"was converted with quantization {method}"):
        jaxllm.load_model(out, quantization=f"{other}_marlin")
