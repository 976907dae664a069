"""Tiny random Llama-family configs and a step runner shared by model tests."""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import KVPool, ModelConfig, RopeScaling, SeqChunk, make_forward, pack_batch
from jaxllm.kv_pool import new_kv_pool
from jaxllm.models import LlamaForCausalLM
from jaxllm.models.llama import has_per_layer_params

# The committed tiny HF checkpoint (random Qwen2 weights with attention biases)
TINY_QWEN = os.path.join(os.path.dirname(__file__), "fixtures", "tiny", "qwen2_bias")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-5)

TINY_CONFIGS = {
    "llama3_rope_scaling": ModelConfig(
        **TINY, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, original_max_position_embeddings=32)),
    "qwen2_bias": ModelConfig(**TINY | {"num_key_value_heads": 1},
                              architecture="Qwen2ForCausalLM", attention_bias=True),
    "mistral_sliding": ModelConfig(**TINY, architecture="MistralForCausalLM", sliding_window=7),
    "llama2_tied_mha": ModelConfig(**TINY | {"num_key_value_heads": 4},
                                   tie_word_embeddings=True),
}


def random_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32):
    """Flax's default init: large enough that logits are far from uniform."""
    model = LlamaForCausalLM(cfg, dtype)
    kv = KVPool.zeros(cfg.num_hidden_layers, 2, 4, cfg.num_key_value_heads, cfg.head_dim, dtype)
    batch = pack_batch([SeqChunk([1, 2], 0, [1])], 4)
    params = model.init(jax.random.key(seed), kv, batch)["params"]
    # Norm scales init to 1; perturb them so a wrong norm placement shows.
    leaves, tree = jax.tree.flatten_with_path(params)
    key = jax.random.key(seed + 1)
    out = []
    for path, leaf in leaves:
        if "scale" in jax.tree_util.keystr(path) or "bias" in jax.tree_util.keystr(path):
            key, sub = jax.random.split(key)
            leaf = leaf + 0.2 * jax.random.normal(sub, leaf.shape, leaf.dtype)
        out.append(leaf)
    return jax.tree.unflatten(tree, out)


class PagedRunner:
    """Runs sequences through the jitted forward in caller-chosen chunks over one pool, packed
    by the engine's own builder (``pack_batch``). The pool's layout follows the params'
    (per-layer params: the unrolled stack)."""

    def __init__(self, cfg: ModelConfig, params, *, block_size: int = 4, num_blocks: int = 64,
                 dtype=jnp.float32, backend: str = "auto"):
        self.cfg, self.params, self.block_size = cfg, params, block_size
        self.pool = new_kv_pool(cfg, num_blocks, block_size, dtype,
                                unroll_layers=has_per_layer_params(params))
        self.forward = jax.jit(make_forward(cfg, dtype, backend), donate_argnums=(1,))

    def step(self, chunks: Sequence[SeqChunk], **pad) -> np.ndarray:
        """Logits f32[total new tokens, V] for every token of every chunk, in order."""
        batch = pack_batch(chunks, self.block_size, all_logits=True, **pad)
        logits, self.pool = self.forward(self.params, self.pool, batch)
        return np.asarray(logits)

    def run(self, tokens: Sequence[int], chunk_sizes: Sequence[int],
            block_table: Sequence[int]) -> np.ndarray:
        """Logits for every position of ``tokens``, fed in chunks of ``chunk_sizes``."""
        out, done = [], 0
        for size in chunk_sizes:
            out.append(self.step([SeqChunk(tokens[done:done + size], done, block_table)]))
            done += size
        assert done == len(tokens)
        return np.concatenate(out)


def prompt_logits(model, ids: Sequence[int], block_size: int = 8) -> np.ndarray:
    """Logits f32[len(ids), V] of ``model`` (a LoadedModel) over one whole-prompt step."""
    blocks = list(range(1, 1 + len(ids) // block_size + 1))
    return PagedRunner(model.config, model.params, block_size=block_size).run(
        ids, [len(ids)], blocks)
