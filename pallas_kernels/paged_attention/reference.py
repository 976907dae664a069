"""Float32 XLA reference for paged attention: the specification every kernel is tested against.

Each flat query token t of sequence s at position p attends, causally, to the positions
``max(0, p - sliding_window + 1) .. p`` of s, read from the pool through ``block_tables[s]``.
The token's own K/V must already be in the pool (the forward writes before it attends).
Rows past ``seq_lens[s]`` are masked in both products, so garbage or NaN in a page tail or
in the null block never reaches the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Queries per pass of the reference; bounds the [chunk, context, Hkv, D] gather on long prefills.
_QUERY_CHUNK = 256


def paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_pool: jax.Array,  # [L, num_blocks, block_size, Hkv, D]
    v_pool: jax.Array,  # [L, num_blocks, block_size, Hkv, D]
    layer: jax.Array | int,  # i32[] which layer of the stacked pool to read
    block_tables: jax.Array,  # i32[S, W]
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    positions: jax.Array,  # i32[T]
    *,
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:  # [T, Hq, D] in q.dtype
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_pool.shape
    num_seqs, width = block_tables.shape
    context = width * block_size
    seq = jnp.minimum(
        jnp.searchsorted(query_start_loc[1:], jnp.arange(num_tokens), side="right",
                         method="scan_unrolled"), num_seqs - 1)

    def attend(q_chunk, seq_chunk, pos_chunk):
        tables = block_tables[seq_chunk]  # [C, W]
        k = k_pool[layer][tables].reshape(-1, context, num_kv_heads, head_dim)  # [C, K, Hkv, D]
        v = v_pool[layer][tables].reshape(-1, context, num_kv_heads, head_dim)
        key_pos = jnp.arange(context)
        valid = (key_pos[None, :] < seq_lens[seq_chunk][:, None]) & (
            key_pos[None, :] <= pos_chunk[:, None])  # [C, K]
        if sliding_window is not None:
            valid &= key_pos[None, :] > pos_chunk[:, None] - sliding_window
        v = jnp.where(valid[:, :, None, None], v.astype(jnp.float32), 0.0)
        qg = q_chunk.astype(jnp.float32).reshape(
            -1, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [C, Hkv, G, D]
        scores = jnp.einsum("tkgd,tckd->tkgc", qg, k.astype(jnp.float32)) * scale
        scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
        row_max = jnp.max(scores, axis=-1, keepdims=True)
        probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
        denom = jnp.sum(probs, axis=-1, keepdims=True)
        probs = probs / jnp.where(denom > 0, denom, 1.0)  # rows with no key (padding) give 0
        out = jnp.einsum("tkgc,tckd->tkgd", probs, v)
        return out.reshape(-1, num_q_heads, head_dim)

    if num_tokens <= _QUERY_CHUNK:
        return attend(q, seq, positions).astype(q.dtype)
    pad = -num_tokens % _QUERY_CHUNK
    chunks = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(
        -1, _QUERY_CHUNK, *x.shape[1:])
    out = jax.lax.map(lambda args: attend(*args), (chunks(q), chunks(seq), chunks(positions)))
    return out.reshape(-1, num_q_heads, head_dim)[:num_tokens].astype(q.dtype)
