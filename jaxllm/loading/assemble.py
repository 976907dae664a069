"""Turns Hugging Face-named tensors into the model's stacked, fused param tree.

Every source (safetensors directory, GGUF file) exposes tensors under Hugging Face names with
Hugging Face layouts ([out, in] for linear weights); this module checks each shape against
the config and builds the tree documented in :mod:`jaxllm.models.llama`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.model_config import ModelConfig

GetTensor = Callable[[str], np.ndarray]


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, for every tensor the model needs."""
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def assemble_params(cfg: ModelConfig, get: GetTensor, available: set[str],
                    dtype: Any, source: str) -> dict:
    """Builds the param tree in ``dtype``; raises ModelLoadError naming any bad tensor."""
    expected = expected_hf_shapes(cfg)
    missing = sorted(set(expected) - available, key=_natural_key)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{source}: missing tensors {missing[:3]}{more}")

    def load(name: str) -> np.ndarray:
        array = get(name)
        if tuple(array.shape) != expected[name]:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(array.shape)} but the config "
                f"expects {expected[name]}")
        return np.asarray(array, dtype=np.float32) if array.dtype != dtype else array

    def stack(fn: Callable[[str], np.ndarray]) -> jnp.ndarray:
        return jnp.asarray(np.stack([fn(f"model.layers.{i}.")
                                     for i in range(cfg.num_hidden_layers)]), dtype)

    def fused(prefix: str, parts: tuple[str, ...], suffix: str) -> np.ndarray:
        arrays = [load(prefix + part + suffix) for part in parts]
        joined = np.concatenate(arrays, axis=0)
        return joined.T if suffix == ".weight" else joined  # [out, in] -> [in, out]

    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    attn = {
        "qkv_proj": {"kernel": stack(lambda p: fused(p, qkv, ".weight"))},
        "o_proj": {"kernel": stack(lambda p: load(p + "self_attn.o_proj.weight").T)},
    }
    if cfg.attention_bias:
        attn["qkv_proj"]["bias"] = stack(lambda p: fused(p, qkv, ".bias"))
    params = {
        "embed_tokens": {"embedding": jnp.asarray(load("model.embed_tokens.weight"), dtype)},
        "layers": {
            "input_layernorm": {"scale": stack(lambda p: load(p + "input_layernorm.weight"))},
            "post_attention_layernorm": {
                "scale": stack(lambda p: load(p + "post_attention_layernorm.weight"))},
            "attn": attn,
            "mlp": {
                "gate_up_proj": {"kernel": stack(
                    lambda p: fused(p, ("mlp.gate_proj", "mlp.up_proj"), ".weight"))},
                "down_proj": {"kernel": stack(lambda p: load(p + "mlp.down_proj.weight").T)},
            },
        },
        "norm": {"scale": jnp.asarray(load("model.norm.weight"), dtype)},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": jnp.asarray(load("lm_head.weight").T, dtype)}
    return params


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]
