"""Device side of pooling (embeddings): per sequence, the final-normed hidden state at its
sampled position and the sum over its tokens in this step. The engine adds the sums of a
prompt's chunks on the host and finishes the embedding (:mod:`jaxllm.pooling_params`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.batch import BatchMetadata


def pool_hidden(hidden: jax.Array, batch: BatchMetadata) -> tuple[jax.Array, jax.Array]:
    """``hidden`` f32|bf16[T, H] (final-normed, every token) -> ``(last f32[N, H], sums
    f32[S, H])``: the rows at ``logits_indices`` and each sequence's sum over its query tokens
    ``query_start_loc[s]:query_start_loc[s + 1]`` (padding tokens belong to none)."""
    hidden = hidden.astype(jnp.float32)
    token = jnp.arange(hidden.shape[0])  # [T]
    starts, ends = batch.query_start_loc[:-1], batch.query_start_loc[1:]  # [S] each
    owns = (token[None, :] >= starts[:, None]) & (token[None, :] < ends[:, None])  # [S, T]
    sums = jnp.dot(owns.astype(jnp.float32), hidden, precision=jax.lax.Precision.HIGHEST)
    return hidden[batch.logits_indices], sums
