"""``jaxllm convert``: a model written as an orbax checkpoint in the engine's precision and
layout loads back bit for bit (the same logits as loading the source with the same settings),
in either layer layout, and through the engine; what cannot be honoured is refused."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from test_loading import TINY_DIR, reference
from tiny_models import prompt_logits

import jaxllm
from jaxllm import ModelLoadError, SamplingParams
from jaxllm.cli import main as cli_main
from jaxllm.loading.orbax_checkpoint import METADATA_FILE

SOURCE = os.path.join(TINY_DIR, "llama3_rope_scaling")


def logits(model):
    ids = reference("llama3_rope_scaling")["input_ids"].tolist()
    return np.asarray(prompt_logits(model.with_layer_layout(False), ids))


def assert_converts_bit_for_bit(source: str, tmp_path) -> dict:
    """``jaxllm convert`` of ``source`` (float32, scanned layout) loaded back in either layer
    layout: the quantization and every leaf's dtype and values of ``source`` loaded alike.
    Returns {unroll_layers: the converted model}."""
    out = str(tmp_path / "converted")
    assert cli_main(["convert", source, out, "--dtype", "float32", "--no-unroll-layers"]) == 0
    want = jaxllm.load_model(source, dtype="float32")
    converted = {}
    for unroll in (False, True):
        got = converted[unroll] = jaxllm.load_model(out, unroll_layers=unroll)
        assert got.quantization == want.quantization
        expected = want.with_layer_layout(unroll).params
        for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(expected), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return converted


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_convert_then_load_gives_the_logits_of_the_source(tmp_path, capsys, quantization):
    out = str(tmp_path / "converted")
    flags = ["-q", quantization] if quantization else []
    assert cli_main(["convert", SOURCE, out, "--dtype", "float32", "--no-unroll-layers",
                     *flags]) == 0
    assert "serve it with `jaxllm serve" in capsys.readouterr().out
    meta = json.load(open(os.path.join(out, METADATA_FILE)))
    assert meta["dtype"] == "float32" and meta["unroll_layers"] is False
    source = jaxllm.load_model(SOURCE, dtype="float32", quantization=quantization)
    converted = jaxllm.load_model(out)
    assert converted.config == source.config
    assert (converted.quantization is None) == (quantization is None)
    for a, b in zip(jax.tree.leaves(converted.params), jax.tree.leaves(source.params),
                    strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(logits(converted), logits(source))
    # The other layer layout, and --load-format orbax named explicitly: the same values.
    per_layer = jaxllm.load_model(out, load_format="orbax", unroll_layers=True)
    assert per_layer.unroll_layers
    np.testing.assert_array_equal(logits(per_layer), logits(source))


def test_the_engine_serves_a_converted_checkpoint(tmp_path):
    out = str(tmp_path / "converted")
    assert cli_main(["convert", SOURCE, out, "--dtype", "float32"]) == 0
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    args = dict(max_num_seqs=4, max_model_len=64, enforce_eager=True,
                compilation_cache_dir=None, progress=False)
    ran = {}
    for name, model in (("source", SOURCE), ("converted", out)):
        llm = jaxllm.LLM(model, dtype="float32", **args)
        ran[name] = [o.outputs[0].token_ids for o in llm.generate(
            prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    assert ran["converted"] == ran["source"]


def test_what_a_converted_checkpoint_cannot_honour_is_refused(tmp_path, capsys):
    out = str(tmp_path / "converted")
    assert cli_main(["convert", SOURCE, out, "--dtype", "float32", "-q", "int8"]) == 0
    with pytest.raises(ValueError, match="converted with dtype float32: load it with dtype "
                                         "auto, or convert again with --dtype bfloat16"):
        jaxllm.load_model(out, dtype="bfloat16")
    with pytest.raises(ValueError, match="converted with quantization int8: load it without "
                                         "--quantization, or convert again with --quantization "
                                         "fp8"):
        jaxllm.load_model(out, quantization="compressed-tensors")
    with pytest.raises(ValueError, match="or convert a gptq checkpoint \\(convert keeps its "
                                         "quantization\\)"):
        jaxllm.load_model(out, quantization="gptq_marlin")
    # Never over an existing checkpoint; a directory without the metadata is not one.
    assert cli_main(["convert", SOURCE, out]) == 2
    assert "exists and is not an empty directory: convert never overwrites" in \
        capsys.readouterr().err
    with pytest.raises(ModelLoadError, match="not a `jaxllm convert` checkpoint"):
        jaxllm.load_model(SOURCE, load_format="orbax")
    meta_path = os.path.join(out, METADATA_FILE)
    meta = json.load(open(meta_path))
    meta["config"]["hidden_size"] *= 2  # the params no longer match what the metadata says
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(ModelLoadError, match="its params do not match its metadata"):
        jaxllm.load_model(out)


def test_convert_takes_dummy_weights(tmp_path, monkeypatch):
    """``--load-format dummy`` reaches the loader (random weights of a preset's or a
    config.json's shape: how start-up from a converted checkpoint is timed without the weights,
    benchmarks/warm_restart), and what it returns is written."""
    calls = []
    load = jaxllm.load_model

    def load_model(model, **kwargs):
        calls.append((model, kwargs["load_format"]))
        return load(model, dtype=kwargs["dtype"], unroll_layers=kwargs["unroll_layers"])

    monkeypatch.setattr(jaxllm, "load_model", load_model)
    out = str(tmp_path / "dummy")
    assert cli_main(["convert", SOURCE, out, "--load-format", "dummy", "--dtype", "float32",
                     "--no-unroll-layers"]) == 0
    assert calls == [(SOURCE, "dummy")]
    assert load(out).config == load(SOURCE, dtype="float32").config


def test_a_restore_in_groups_loads_every_leaf_under_a_progress_bar(tmp_path, monkeypatch,
                                                                   capsys):
    """The restore goes group by group (here a group a leaf, each a partial orbax restore of
    its leaves) and reports its progress in GiB; every leaf comes back as written."""
    from jaxllm.loading import orbax_checkpoint

    out = str(tmp_path / "converted")
    assert cli_main(["convert", SOURCE, out, "--dtype", "float32", "--no-unroll-layers"]) == 0
    capsys.readouterr()
    restores = []
    groups = orbax_checkpoint.restore_groups
    monkeypatch.setattr(orbax_checkpoint, "restore_groups",
                        lambda leaves, size: restores.extend(groups(leaves, 1)) or restores)
    got = jaxllm.load_model(out)
    want = jaxllm.load_model(SOURCE, dtype="float32")
    leaves = jax.tree.leaves(want.params)
    assert len(restores) == len(leaves) > 1
    for a, b in zip(jax.tree.leaves(got.params), leaves, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "Loading orbax checkpoint: 100%" in capsys.readouterr().err


def test_restore_groups_cut_the_leaves_in_order_by_bytes():
    from jaxllm.loading.orbax_checkpoint import restore_groups

    leaves = [jax.ShapeDtypeStruct((n,), np.float32) for n in (256, 256, 1024, 8, 8)]
    assert restore_groups(leaves, 2048) == [{0, 1}, {2}, {3, 4}]
    assert restore_groups(leaves, 1 << 30) == [{0, 1, 2, 3, 4}]
    assert restore_groups([], 1) == []
