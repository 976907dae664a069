"""Loading Hugging Face directories, GGUF files and dummy weights, and the errors for bad input."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import prompt_logits

import jaxllm
from jaxllm import ModelConfig, ModelLoadError, UnsupportedModelError

TINY_DIR = os.path.join(os.path.dirname(__file__), "fixtures", "tiny")
TINY_NAMES = ["llama3_rope_scaling", "llama2_tied", "qwen2_bias", "mistral_sliding"]


def reference(name):
    return np.load(os.path.join(TINY_DIR, name, "reference_logits.npz"))


@pytest.mark.parametrize("name", TINY_NAMES)
def test_hf_directory_matches_transformers_logits(name):
    model = jaxllm.load_model(os.path.join(TINY_DIR, name), dtype="float32")
    ref = reference(name)
    ids = ref["input_ids"].tolist()
    logits = prompt_logits(model, ids)
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=1e-4)
    out = jaxllm.generate(model.params, jnp.asarray([ids]), jnp.asarray([len(ids)]),
                          jax.random.key(0), config=model.config, max_new_tokens=16)
    assert np.asarray(out.tokens[0]).tolist() == ref["greedy_ids"].tolist()


def test_configs_from_hf_carry_family_features():
    load = lambda n: json.load(open(os.path.join(TINY_DIR, n, "config.json")))
    llama3 = ModelConfig.from_hf_config(load("llama3_rope_scaling"))
    assert llama3.rope_scaling.rope_type == "llama3" and llama3.rope_scaling.factor == 8.0
    assert ModelConfig.from_hf_config(load("llama2_tied")).tie_word_embeddings
    assert ModelConfig.from_hf_config(load("qwen2_bias")).attention_bias
    assert ModelConfig.from_hf_config(load("mistral_sliding")).sliding_window == 8


@pytest.mark.parametrize("dtype, expected", [("bfloat16", jnp.bfloat16), ("float16", jnp.float16),
                                             ("float32", jnp.float32)])
def test_dtypes(dtype, expected):
    model = jaxllm.load_model(os.path.join(TINY_DIR, "qwen2_bias"), dtype=dtype)
    assert {leaf.dtype for leaf in jax.tree.leaves(model.params)} == {jnp.dtype(expected)}


@pytest.mark.parametrize("name, unroll", [("llama3_rope_scaling", False), ("qwen2_bias", True)])
def test_leaves_made_on_the_device_equal_the_host_reads_bit_for_bit(name, unroll):
    """The fast path (the stored rows moved raw, then cast, fused and transposed on the
    device) gives exactly the params of the host-side spec (``Leaf.read``): GQA q/k/v fused
    by KV head (and their biases), gate/up interleaved, lm_head transposed, each cast from the
    checkpoint's float32, stacked and per layer."""
    import dataclasses

    from jaxllm.loading.assemble import Leaf, StackedLeaf, hf_leaves, materialize
    from jaxllm.loading.safetensors_io import open_checkpoint

    def host_only(leaf):
        if isinstance(leaf, StackedLeaf):
            return dataclasses.replace(leaf, layers=tuple(map(host_only, leaf.layers)))
        return dataclasses.replace(leaf, put=None)

    path = os.path.join(TINY_DIR, name)
    config = jaxllm.loading._read_hf_config(os.path.join(path, "config.json"))
    tensors = open_checkpoint(path)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        leaves = hf_leaves(config, config, lambda n: tensors[n].get(n), set(tensors),
                           jnp.dtype(dtype), path, unroll_layers=unroll)
        is_leaf = lambda x: isinstance(x, Leaf)  # noqa: E731
        assert all(leaf.put is not None for leaf in jax.tree.leaves(leaves, is_leaf=is_leaf)
                   if not isinstance(leaf, StackedLeaf))
        got = materialize(leaves, dtype, None)
        want = materialize(jax.tree.map(host_only, leaves, is_leaf=is_leaf), dtype, None)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.dtype == b.dtype == dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                          np.asarray(b).view(np.uint8))


def test_dummy_weights_have_the_real_shapes_without_reading_files():
    cfg = ModelConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=16)
    model = jaxllm.load_model(load_format="dummy", config=cfg, dtype="bfloat16")
    layers = model.params["layers"]
    assert layers["attn"]["qkv_proj"]["kernel"].shape == (3, 128, (8 + 2 * 2) * 16)
    assert layers["mlp"]["gate_up_proj"]["kernel"].shape == (3, 128, 512)
    assert model.params["lm_head"]["kernel"].shape == (128, 1000)
    values = np.asarray(layers["attn"]["o_proj"]["kernel"], np.float32)
    assert 0 < np.abs(values).max() <= 1e-3
    # A config.json alone is enough for dummy weights.
    path = os.path.join(TINY_DIR, "llama2_tied", "config.json")
    assert jaxllm.load_model(path, load_format="dummy").config.tie_word_embeddings


def test_tokenizer_flag_gives_dummy_weights_a_tokenizer(tmp_path, smollm2_header):
    """vLLM's --tokenizer: a tokenizer.json (no special-token roles: EOS from the model), a
    .gguf or an HF directory replaces the model's; a missing path fails before any weight."""
    from jaxllm.loading import default_model_path

    _, gguf_tokenizer = smollm2_header
    path = str(tmp_path / "tokenizer.json")
    gguf_tokenizer.backend_tokenizer.save(path)
    cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, eos_token_ids=(2,))
    model = jaxllm.load_model(load_format="dummy", config=cfg, tokenizer=path)
    ids = gguf_tokenizer("paged attention")["input_ids"]
    assert model.tokenizer("paged attention")["input_ids"] == ids
    assert model.tokenizer.eos_token_id == 2
    assert model.tokenizer.decode(ids) == "paged attention"
    from_gguf = jaxllm.load_model(load_format="dummy", config=cfg,
                                  tokenizer=default_model_path())
    assert from_gguf.tokenizer.chat_template == gguf_tokenizer.chat_template
    assert jaxllm.load_model(load_format="dummy", config=cfg).tokenizer is None
    with pytest.raises(ModelLoadError, match="--tokenizer .*no such file"):
        jaxllm.load_model(load_format="dummy", config=cfg, tokenizer=str(tmp_path / "none"))


def test_missing_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        jaxllm.load_model("/no/such/model")


def test_unsupported_architecture(tmp_path):
    shutil.copytree(os.path.join(TINY_DIR, "llama2_tied"), tmp_path / "m")
    cfg = json.load(open(tmp_path / "m" / "config.json"))
    cfg["architectures"], cfg["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
    json.dump(cfg, open(tmp_path / "m" / "config.json", "w"))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM.*not supported"):
        jaxllm.load_model(str(tmp_path / "m"))


def test_unsupported_rope_scaling_and_activation():
    base = json.load(open(os.path.join(TINY_DIR, "llama2_tied", "config.json")))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_config(base | {"rope_scaling": {"rope_type": "yarn", "factor": 4}})
    with pytest.raises(UnsupportedModelError, match="gelu"):
        ModelConfig.from_hf_config(base | {"hidden_act": "gelu"})


def test_mismatched_tensor_shapes(tmp_path):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(os.path.join(TINY_DIR, "llama2_tied"), tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name][:, :-1].copy()
    save_file(weights, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"down_proj.weight.*shape \(64, 127\).*\(64, 128\)"):
        jaxllm.load_model(str(tmp_path / "m"))


def test_missing_tensor_and_corrupt_file(tmp_path):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(os.path.join(TINY_DIR, "llama2_tied"), tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    del weights["model.layers.0.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing tensors.*k_proj"):
        jaxllm.load_model(str(tmp_path / "m"))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x05not a file")
    with pytest.raises(ModelLoadError, match="not a readable safetensors"):
        jaxllm.load_model(str(tmp_path / "m"))


def _write_gguf(path, tensor_type):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_context_length(64)
    writer.add_vocab_size(8)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("a") + i) for i in range(8)])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (8, 32), "output_norm.weight": (32,),
              "blk.0.attn_norm.weight": (32,), "blk.0.ffn_norm.weight": (32,),
              "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (32, 32),
              "blk.0.attn_v.weight": (32, 32), "blk.0.attn_output.weight": (32, 32),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32),
              "blk.0.ffn_down.weight": (32, 64)}
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 2 and tensor_type != gguf.GGMLQuantizationType.F32:
            raw = gguf.quants.quantize(np.tile(data, (1, 8)) if shape[1] < 256 else data,
                                       tensor_type)
            writer.add_tensor(name, raw, raw_dtype=tensor_type)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_loads_and_runs(tmp_path):
    import gguf

    _write_gguf(tmp_path / "ok.gguf", gguf.GGMLQuantizationType.F32)
    model = jaxllm.load_model(str(tmp_path / "ok.gguf"))
    assert model.config.tie_word_embeddings and model.config.num_hidden_layers == 1
    out = jaxllm.generate(model.params, jnp.asarray([[1, 2, 3]]), jnp.asarray([3]),
                          jax.random.key(0), config=model.config, max_new_tokens=3)
    assert out.tokens.shape == (1, 3)


def test_gguf_with_unsupported_quantization_type(tmp_path):
    import gguf

    _write_gguf(tmp_path / "tq.gguf", gguf.GGMLQuantizationType.TQ1_0)
    with pytest.raises(UnsupportedModelError, match="TQ1_0 not supported; supported: F32"):
        jaxllm.load_model(str(tmp_path / "tq.gguf"))


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        jaxllm.load_model(str(tmp_path / "bad.gguf"))


def _gguf_package_view(path):
    """What the ``gguf`` package's own reader finds in ``path``."""
    import gguf

    reader = gguf.GGUFReader(path)
    metadata = {}
    for name, field in reader.fields.items():
        try:
            metadata[name] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError):
            metadata[name] = None
    return metadata, reader.tensors


@pytest.mark.parametrize("which", ["embedded", "q4_1"])
def test_gguf_header_reads_what_the_gguf_package_reads(which, tmp_path):
    """jaxllm's header parser against gguf's reader: the same metadata values (SmolLM2's
    whole tokenizer included), tensor names, types, shapes and bytes."""
    import gguf

    from jaxllm.loading.gguf_reader import read_gguf

    if which == "embedded":
        path = jaxllm.loading.default_model_path()
    else:
        path = str(tmp_path / "q.gguf")
        _write_gguf(path, gguf.GGMLQuantizationType.Q4_1)
    ours = read_gguf(path)
    metadata, tensors = _gguf_package_view(path)
    assert ours.metadata == metadata
    assert [t.name for t in ours.tensors] == [t.name for t in tensors]
    for mine, theirs in zip(ours.tensors, tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(theirs.shape.tolist())
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        np.testing.assert_array_equal(mine.data, theirs.data)


def test_gguf_text_that_is_not_utf8_reads_as_none_and_the_rest_still_reads(tmp_path):
    """An undecodable string inside the token list makes that field None, as gguf's reader
    does, and every field after it still parses."""
    import gguf

    from jaxllm.loading.gguf_reader import read_gguf

    _write_gguf(tmp_path / "ok.gguf", gguf.GGMLQuantizationType.F32)
    whole = (tmp_path / "ok.gguf").read_bytes()
    at = whole.index(b"\x01\x00\x00\x00\x00\x00\x00\x00c")  # the token "c", 1 byte long
    (tmp_path / "bad_text.gguf").write_bytes(whole[:at + 8] + b"\xff" + whole[at + 9:])
    ours = read_gguf(str(tmp_path / "bad_text.gguf"))
    metadata, _ = _gguf_package_view(str(tmp_path / "bad_text.gguf"))
    assert ours.metadata["tokenizer.ggml.tokens"] is None
    assert ours.metadata == metadata
    assert len(ours.tensors) == 11


def test_truncated_gguf_files_are_refused_clearly(tmp_path):
    import gguf

    _write_gguf(tmp_path / "ok.gguf", gguf.GGMLQuantizationType.F32)
    whole = (tmp_path / "ok.gguf").read_bytes()
    for size, why in [(200, "truncated GGUF header|runs past the end"),
                      (len(whole) - 100, "runs past the end of the file")]:
        (tmp_path / "cut.gguf").write_bytes(whole[:size])
        with pytest.raises(ModelLoadError, match=f"not a readable GGUF file .*({why})"):
            jaxllm.load_model(str(tmp_path / "cut.gguf"))
    (tmp_path / "v1.gguf").write_bytes(b"GGUF" + (1).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ModelLoadError, match="GGUF version 1"):
        jaxllm.load_model(str(tmp_path / "v1.gguf"))


def test_bad_dtype_and_load_format():
    with pytest.raises(ValueError, match="dtype 'int4' must be one of"):
        jaxllm.load_model(os.path.join(TINY_DIR, "qwen2_bias"), dtype="int4")
    with pytest.raises(ValueError, match="load_format 'pt' must be one of"):
        jaxllm.load_model(os.path.join(TINY_DIR, "qwen2_bias"), load_format="pt")
