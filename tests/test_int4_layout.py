"""``JAXLLM_INT4_HOPPER=auto`` (jaxllm/engine/int4_layout.py): both 4-bit layouts only where the
Hopper kernel runs and the N-major copy is small beside the device's memory; the engine and
the latency benchmark build what it resolves to."""

from __future__ import annotations

import logging

import jax
import pytest
from tiny_models import TINY

import jaxllm
from jaxllm import ModelConfig, SamplingParams
from jaxllm.engine import int4_layout
from jaxllm.engine.device_memory import stored_bytes
from jaxllm.engine.int4_layout import (
    AUTO_COPY_MAX_SHARE,
    n_major_copy_bytes,
    resolve_int4_layout,
)
from jaxllm.layers.linear import Int4Weight, Int4WeightNK, int4_hopper_mode

HOPPER = "9.0"


@pytest.fixture(scope="module")
def awq_model():
    return jaxllm.load_model(load_format="dummy", config=ModelConfig(**TINY),
                             quantization="awq", unroll_layers=True)


def _int4_leaves(params):
    return [leaf for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int4Weight))
            if isinstance(leaf, Int4Weight)]


def test_copy_bytes_are_what_the_built_copy_takes(awq_model):
    both = awq_model.with_int4_n_major("both")
    copies = [leaf.n_major for leaf in _int4_leaves(both.params)]
    assert copies and all(isinstance(c, Int4WeightNK) for c in copies)
    assert n_major_copy_bytes(awq_model.params) == sum(stored_bytes(c.w) for c in copies)
    hidden, q, kv, mlp = 64, 4 * 16, 2 * 16, 96  # TINY's projections, half a byte a weight
    weights = hidden * (q + 2 * kv) + q * hidden + hidden * 2 * mlp + mlp * hidden
    assert n_major_copy_bytes(awq_model.params) == TINY["num_hidden_layers"] * weights // 2


def test_auto_keeps_both_layouts_only_on_a_hopper_gpu_with_room(awq_model):
    copy = n_major_copy_bytes(awq_model.params)
    roomy = copy / AUTO_COPY_MAX_SHARE
    assert resolve_int4_layout("auto", awq_model, roomy, HOPPER) == ("both", None)
    layout, why = resolve_int4_layout("auto", awq_model, roomy - 64, HOPPER)
    assert layout == "off" and "N-major copy" in why and "1/16 of the device's memory" in why
    layout, why = resolve_int4_layout("auto", awq_model, None, HOPPER)  # memory unknown
    assert layout == "off" and "N-major copy" in why
    assert resolve_int4_layout("auto", awq_model, roomy, "8.0") == (
        "off", "not a Hopper GPU (compute capability 8.0)")
    assert resolve_int4_layout("auto", awq_model, roomy, None)[0] == "off"  # the CPU
    stacked = awq_model.with_layer_layout(False)
    assert resolve_int4_layout("auto", stacked, roomy, HOPPER) == ("off", "stacked layers")


def test_explicit_settings_and_models_without_4_bit_weights_pass_through(awq_model):
    for setting in ("off", "on", "both"):
        assert resolve_int4_layout(setting, awq_model, None, None) == (setting, None)
    bf16 = jaxllm.load_model(load_format="dummy", config=ModelConfig(**TINY))
    assert resolve_int4_layout("auto", bf16, 1 << 40, HOPPER) == ("off", None)
    with pytest.raises(ValueError, match="the engine resolves 'auto'"):
        awq_model.with_int4_n_major("auto")


def test_auto_is_the_default():
    """Unset or blank, JAXLLM_INT4_HOPPER is "auto" (both layouts timed 1.16x offline with
    the one-row step unchanged: RESULTS.md, H100, 2026-12-07)."""
    assert int4_hopper_mode({}) == int4_hopper_mode({"JAXLLM_INT4_HOPPER": " "}) == "auto"
    assert int4_hopper_mode({"JAXLLM_INT4_HOPPER": "off"}) == "off"


def test_engine_builds_what_auto_resolves_to(awq_model, monkeypatch, caplog):
    """On this CPU the default ("auto") keeps the packed words only and says why; told it runs
    on a Hopper GPU with room, the engine keeps the N-major copy too, with the same greedy
    tokens."""
    monkeypatch.delenv("JAXLLM_INT4_HOPPER", raising=False)
    args = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16,
                unroll_layers=True, progress=False)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([1, 2, 3], [4, 5, 6, 7])]
    tokens = {}
    for hopper in (False, True):
        if hopper:
            monkeypatch.setattr(jaxllm.attention, "device_compute_capability", lambda: HOPPER)
            monkeypatch.setattr(int4_layout, "total_device_memory", lambda device: 1 << 40)
        with caplog.at_level(logging.INFO, logger=int4_layout.__name__):
            caplog.clear()
            llm = jaxllm.LLM(awq_model, **args)
        kernel = llm.engine.model.params["layers"][0]["mlp"]["down_proj"]["kernel"]
        assert isinstance(kernel, Int4Weight)
        assert isinstance(kernel.n_major, Int4WeightNK) == hopper
        said = [r.getMessage() for r in caplog.records]
        copy_gib = n_major_copy_bytes(awq_model.params) / 2**30
        assert said == ([f"4-bit weights: packed words and an N-major copy for the Hopper "
                         f"kernel (+{copy_gib:.2f} GiB)"] if hopper else
                        ["4-bit weights: packed words only (not a Hopper GPU (compute "
                         "capability None))"])
        tokens[hopper] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert tokens[True] == tokens[False]
