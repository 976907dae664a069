"""Parity with Hugging Face transformers (torch, float32) on the real SmolLM2 weights.

The expected values come from tests/reference/make_hf_fixtures.py, which loads the same GGUF
through transformers' own dequantizer and tokenizer converter.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm import SeqChunk, pack_batch

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    with open(os.path.join(FIXTURES, "smollm2_parity.json")) as f:
        data = json.load(f)
    logits = np.load(os.path.join(FIXTURES, "smollm2_last_logits.npz"))["logits"]
    return data, logits


def test_fixture_covers_the_promised_prompts(reference):
    data, logits = reference
    lengths = [len(p["prompt_ids"]) for p in data["prompts"]]
    assert len(lengths) >= 6 and min(lengths) <= 5 and max(lengths) >= 300
    assert any(any("\u4e00" <= ch <= "\u9fff" for ch in p["text"]) for p in data["prompts"])
    assert all(len(p["greedy_ids"]) == 32 for p in data["prompts"])
    assert logits.shape == (len(lengths), 49152)


def test_tokenizer_matches_transformers(smollm2, reference):
    data, _ = reference
    tok = smollm2.tokenizer
    for prompt in data["prompts"]:
        assert tok(prompt["text"])["input_ids"] == prompt["prompt_ids"], prompt["name"]
    for check in data["decode_checks"]:
        ids = next(p["prompt_ids"] for p in data["prompts"] if p["name"] == check["name"])
        assert tok.decode(ids) == check["decoded"], check["name"]
    for chat in data["chat_template"]:
        rendered = tok.apply_chat_template(
            chat["messages"], tokenize=False, add_generation_prompt=chat["add_generation_prompt"])
        assert rendered == chat["rendered"], chat["name"]


def test_last_position_logits_match(smollm2, reference):
    data, expected = reference
    cfg = smollm2.config
    forward = jax.jit(jaxllm.make_forward(cfg, jnp.float32))
    block_size = 16
    chunks, next_block = [], 1
    for prompt in data["prompts"]:
        n_blocks = -(-len(prompt["prompt_ids"]) // block_size)
        chunks.append(SeqChunk(prompt["prompt_ids"], 0,
                               list(range(next_block, next_block + n_blocks))))
        next_block += n_blocks
    pool = jaxllm.KVPool.zeros(cfg.num_hidden_layers, next_block, block_size,
                               cfg.num_key_value_heads, cfg.head_dim, jnp.float32)
    logits, _ = forward(smollm2.params, pool, pack_batch(chunks, block_size))
    logits = np.asarray(logits)
    for i, prompt in enumerate(data["prompts"]):
        scale = np.abs(expected[i]).max()
        err = np.abs(logits[i] - expected[i]).max() / scale
        assert err < 1e-3, f"{prompt['name']}: max relative error {err:.2e}"


def test_greedy_generation_matches_token_for_token(smollm2, reference):
    data, _ = reference
    prompts = [p["prompt_ids"] for p in data["prompts"]]
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    out = jaxllm.generate(smollm2.params, jnp.asarray(ids),
                          jnp.asarray([len(p) for p in prompts]), jax.random.key(0),
                          config=smollm2.config, max_new_tokens=32)
    tokens = np.asarray(out.tokens)
    for i, prompt in enumerate(data["prompts"]):
        assert tokens[i].tolist() == prompt["greedy_ids"], prompt["name"]
