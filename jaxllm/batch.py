"""The paged KV pool and the per-step batch metadata the model forward reads.

Tokens of all sequences in a step are flattened into one ragged axis ``T`` (padded to a
bucket). Sequence ``s`` owns the query tokens ``query_start_loc[s]:query_start_loc[s+1]``
and, in the pool, the blocks listed in ``block_tables[s]``::

    block_tables[s] = [7, 2, 9, 0, 0]        (0 = the reserved null block, used as padding)
    pool block 7: positions  0..15 of s
    pool block 2: positions 16..31 of s
    pool block 9: positions 32..47 of s      (partly filled: seq_lens[s] = 40)

A token at position p lives in slot ``block_tables[s][p // B] * B + p % B``; the slot mapping
tells the forward where to write each new token's K/V. Padded tokens write to slots of
block 0, which no real sequence reads.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

NULL_BLOCK = 0


@flax.struct.dataclass
class KVPool:
    """Per-layer K and V pools, stacked on the layer axis."""

    k: jax.Array  # [L, num_blocks, block_size, Hkv, D]
    v: jax.Array  # [L, num_blocks, block_size, Hkv, D]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @classmethod
    def zeros(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
              head_dim: int, dtype: jnp.dtype) -> KVPool:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


@flax.struct.dataclass
class BatchMetadata:
    """Everything one forward step needs besides params and the pool.

    T = padded token count, S = padded sequence count, W = padded block-table width,
    N = number of tokens whose logits are wanted.
    """

    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]   position of each token within its sequence
    slot_mapping: jax.Array  # i32[T]   pool slot to write each token's K/V (padding -> block 0)
    block_tables: jax.Array  # i32[S, W] pool block ids per sequence (padding -> 0)
    seq_lens: jax.Array  # i32[S]   context length after this step (0 for padded sequences)
    query_start_loc: jax.Array  # i32[S + 1] start of each sequence's tokens in T (non-decreasing)
    logits_indices: jax.Array  # i32[N]   flat token indices whose logits are returned
    # Static: every sequence has one query token (picks the decode kernel). None: decided by
    # the shapes (T == S).
    decode_only: bool | None = flax.struct.field(pytree_node=False, default=None)


def token_seq_ids(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """Sequence index of every flat token: i32[T]. Tokens past the last sequence map to S-1."""
    num_seqs = query_start_loc.shape[0] - 1
    ids = jnp.searchsorted(query_start_loc[1:], jnp.arange(num_tokens), side="right")
    return jnp.minimum(ids, num_seqs - 1).astype(jnp.int32)


def slots_for_positions(block_tables: jax.Array, positions: jax.Array,
                        block_size: int) -> jax.Array:
    """Pool slot of each (sequence row, position): block_tables [S, W], positions [S, ...]."""
    block_idx = positions // block_size
    blocks = jnp.take_along_axis(block_tables, block_idx.reshape(block_tables.shape[0], -1),
                                 axis=1).reshape(positions.shape)
    return blocks * block_size + positions % block_size
