"""Rotary position embeddings in the Hugging Face "rotate half" layout, with llama3 scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """f32[D/2]: the per-pair rotation frequencies after any scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(is_medium, blended, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin: f32[T, D] for positions i32[T]."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inverse_frequencies(config))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x: [T, H, D] by cos/sin [T, D], computing in float32 like the reference."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, None, :] + rotated * sin[:, None, :]
    return out.astype(x.dtype)
