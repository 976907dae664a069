"""Token sampling on device: greedy, temperature, top-k and top-p, batched per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(
    logits: jax.Array,  # f32[B, V]
    key: jax.Array,  # PRNG key
    temperature: jax.Array,  # f32[B]  0 = greedy
    top_k: jax.Array,  # i32[B]  0 = off
    top_p: jax.Array,  # f32[B]  1 = off
) -> jax.Array:  # i32[B]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def filter_top_k_top_p(scaled):
        vocab = logits.shape[-1]
        ordered = -jnp.sort(-scaled, axis=-1)  # descending
        kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
        use_k = top_k[:, None] > 0
        ordered = jnp.where(use_k & (ordered < kth), -jnp.inf, ordered)
        probs = jax.nn.softmax(ordered, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
        cutoff = jnp.take_along_axis(ordered, (jnp.sum(keep, -1) - 1)[:, None], axis=-1)
        return jnp.where((scaled < cutoff) | (use_k & (scaled < kth)), -jnp.inf, scaled)

    def sample(_):
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        # Sorting the vocabulary (and a cumsum over it) is the costly part: only when some row
        # asks for top-k or top-p, as the engine's sampler variants do.
        filtering = jnp.any((top_k > 0) | (top_p < 1.0))
        masked = jax.lax.cond(filtering, filter_top_k_top_p, lambda x: x, scaled)
        drawn = jax.random.categorical(key, masked, axis=-1).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    # All-greedy batches skip sampling altogether.
    return jax.lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, None)
