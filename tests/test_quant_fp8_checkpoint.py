"""FP8 checkpoints in compressed-tensors' ``float-quantized`` format (llm-compressor's
FP8_DYNAMIC), read as they are stored, against the fixtures that compressed-tensors itself
wrote (``tests/reference/make_fp8_fixtures.py``): the e4m3 weights and their scales dequantize
to what the library dequantizes, the model's logits are transformers' over those weights with
each projection's input quantized per token by the library, and every other scheme is refused
naming what (before any tensor is read: the refusal table in tests/test_quantization.py)."""

from __future__ import annotations

import copy
import json
import os

import jax
import numpy as np
import pytest
from test_convert import assert_converts_bit_for_bit
from test_engine import run_all
from tiny_models import prompt_logits

import jaxllm
from jaxllm.layers import Fp8Weight
from jaxllm.loading.assemble import gate_up_columns, qkv_columns
from jaxllm.quantization import resolve_quantization

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "quant")
CASES = ["fp8_channel", "fp8_tensor"]  # one scale per output row; one per tensor


def reference(name: str):
    return np.load(os.path.join(FIXTURES, name, "reference.npz"))


def checkpoint_config(name: str) -> dict:
    with open(os.path.join(FIXTURES, name, "config.json")) as f:
        return json.load(f)["quantization_config"]


def fused(ref, prefixes: list[str], columns) -> np.ndarray:
    """The fused kernel [K, N] jaxllm builds from HF projections [out, in]."""
    parts, rows = columns
    return np.stack([ref[prefixes[p] + ".dequantized"][r]
                     for p, r in zip(parts, rows, strict=True)], axis=1)


@pytest.mark.parametrize("name", CASES)
def test_weights_dequantize_to_what_compressed_tensors_gives(name):
    model = jaxllm.load_model(os.path.join(FIXTURES, name), dtype="float32")
    assert model.quantization.method == "fp8" and model.quantization.from_checkpoint
    ref, cfg = reference(name), model.config
    qkv, gate_up = qkv_columns(cfg, cfg), gate_up_columns(cfg.intermediate_size)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        kernels = {
            "qkv_proj": fused(ref, [p + f"self_attn.{x}_proj" for x in "qkv"], qkv),
            "o_proj": ref[p + "self_attn.o_proj.dequantized"].T,
            "gate_up_proj": fused(ref, [p + "mlp.gate_proj", p + "mlp.up_proj"], gate_up),
            "down_proj": ref[p + "mlp.down_proj.dequantized"].T,
        }
        layer = model.params["layers"]
        for module, expected in kernels.items():
            group = "attn" if module in ("qkv_proj", "o_proj") else "mlp"
            weight = layer[group][module]["kernel"]
            assert isinstance(weight, Fp8Weight) and weight.qt.dtype == np.dtype("float8_e4m3fn")
            # Stored as the checkpoint stores it: [out, in], K-major for the FP8 GEMM.
            assert weight.qt.shape[1:] == expected.T.shape
            np.testing.assert_array_equal(np.asarray(weight.dequantize())[i], expected)


@pytest.mark.parametrize("name", CASES)
def test_logits_are_transformers_with_per_token_fp8_inputs(name):
    model = jaxllm.load_model(os.path.join(FIXTURES, name), dtype="float32")
    ref = reference(name)
    ids = ref["input_ids"].tolist()
    logits = prompt_logits(model, ids)
    # Measured 1.7e-6 apart at most; the float checkpoint they came from is 0.27-0.49 away.
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-5, rtol=1e-5)


def test_the_engine_serves_an_fp8_checkpoint():
    """``--quantization fp8`` agrees with the checkpoint; the engine's greedy tokens are those
    of ``generate()`` over the same params."""
    import jax.numpy as jnp

    model = jaxllm.load_model(os.path.join(FIXTURES, "fp8_channel"), dtype="float32",
                              quantization="fp8")
    assert "checkpoint" in model.quantization.describe()
    prompt = reference("fp8_channel")["input_ids"][:12].tolist()
    llm = jaxllm.LLM(model, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                     num_gpu_blocks_override=16, block_size=8, enforce_eager=True,
                     compilation_cache_dir=None, progress=False)
    got = run_all(llm.engine, [prompt], [8])[0].outputs[0].token_ids
    out = jaxllm.generate(model.params, jnp.asarray([prompt]), jnp.asarray([len(prompt)]),
                          jax.random.key(0), config=model.config, max_new_tokens=8)
    assert got == np.asarray(out.tokens[0]).tolist()


def test_compressed_tensors_names_the_checkpoints_own_quantization():
    """vLLM's ``--quantization compressed-tensors`` reads an FP8 checkpoint as no flag does
    (and is refused for a float checkpoint: :mod:`test_quantization`)."""
    stored = checkpoint_config("fp8_channel")
    assert resolve_quantization("compressed-tensors", stored) == resolve_quantization(
        None, stored) == resolve_quantization("fp8", stored)
    model = jaxllm.load_model(os.path.join(FIXTURES, "fp8_channel"), dtype="float32",
                              quantization="compressed-tensors")
    assert model.quantization.method == "fp8" and model.quantization.from_checkpoint
    assert model.with_quantization("compressed-tensors") is model


def _edited(change) -> dict:
    qc = copy.deepcopy(checkpoint_config("fp8_channel"))
    change(qc)
    return qc


def _group(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]


REFUSED = {
    "static activations": (lambda qc: _group(qc)["input_activations"].update(
        dynamic=False, strategy="tensor"), "only dynamic per-token FP8 activations"),
    "weight-only FP8": (lambda qc: _group(qc).update(input_activations=None),
                        "only dynamic per-token FP8 activations"),
    "block scales": (lambda qc: _group(qc)["weights"].update(strategy="block"),
                     "weight strategy 'block'"),
    "int8 weights": (lambda qc: _group(qc)["weights"].update(type="int"),
                     "only symmetric 8-bit float"),
    "FP8 KV cache": (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
                     "an FP8 KV cache is not supported"),
    "quantized LM head": (lambda qc: qc.update(ignore=[]), "the LM head is quantized"),
    "two groups": (lambda qc: qc["config_groups"].update(group_1=_group(qc)),
                   "exactly one"),
    "packed format": (lambda qc: qc.update(format="pack-quantized"),
                      "in format 'pack-quantized'"),
    "HF fp8 method": (lambda qc: qc.update(quant_method="fp8"),
                      "quant_method 'fp8': not supported yet"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_other_schemes_are_refused_naming_what(case):
    change, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        resolve_quantization(None, _edited(change))


def test_convert_keeps_an_fp8_checkpoint_as_it_is(tmp_path):
    """``jaxllm convert`` of an FP8 checkpoint: the same e4m3 weights and scales, bit for bit,
    in either layer layout."""
    assert_converts_bit_for_bit(os.path.join(FIXTURES, "fp8_tensor"), tmp_path)
