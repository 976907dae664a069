"""The paged KV pool and the per-step batch metadata the model forward reads.

Tokens of all sequences in a step are flattened into one ragged axis ``T`` (padded to a
bucket). Sequence ``s`` owns the query tokens ``query_start_loc[s]:query_start_loc[s+1]``
and, in the pool, the blocks listed in ``block_tables[s]``::

    block_tables[s] = [7, 2, 9, 0, 0]        (0 = the reserved null block, used as padding)
    pool block 7: positions  0..15 of s
    pool block 2: positions 16..31 of s
    pool block 9: positions 32..47 of s      (partly filled: seq_lens[s] = 40)

A token at position p lives in slot ``block_tables[s][p // B] * B + p % B``; the slot mapping
tells the forward where to write each new token's K/V. Padded tokens have slot
``PAD_SLOT`` (-1): their writes are dropped, so block 0 stays zeros.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

NULL_BLOCK = 0
PAD_SLOT = -1  # slot_mapping of a padded token: nothing is written


@flax.struct.dataclass
class KVPool:
    """Per-layer K and V pools, stacked on the layer axis."""

    k: jax.Array  # [L, num_blocks, block_size, Hkv, D]
    v: jax.Array  # [L, num_blocks, block_size, Hkv, D]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of one layer: (block_size, Hkv, D)."""
        return tuple(self.k.shape[2:])

    @property
    def dtype(self):
        return self.k.dtype

    @classmethod
    def zeros(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
              head_dim: int, dtype: jnp.dtype) -> KVPool:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def read_blocks(self, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K and V of blocks ``ids`` (i32[n]) in every layer: [L, n, block_size, Hkv, D] each."""
        return self.k[:, ids], self.v[:, ids]

    def write_blocks(self, ids: jax.Array, k: jax.Array, v: jax.Array) -> KVPool:
        return KVPool(k=self.k.at[:, ids].set(k), v=self.v.at[:, ids].set(v))



@flax.struct.dataclass
class LayeredKVPool:
    """The same pool as :class:`KVPool`, one array pair per layer. An unrolled layer stack
    updates each layer's arrays once and reads them once, so XLA can keep every update in place
    (a stacked pool is written, read, then written again by the next layer)."""

    k: tuple[jax.Array, ...]  # L x [1, num_blocks, block_size, Hkv, D]
    v: tuple[jax.Array, ...]  # L x [1, num_blocks, block_size, Hkv, D]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[1]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.k[0].shape[2:])

    @property
    def dtype(self):
        return self.k[0].dtype

    @classmethod
    def zeros(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
              head_dim: int, dtype: jnp.dtype) -> LayeredKVPool:
        shape = (1, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))

    def layer(self, index: int) -> KVPool:
        """Layer ``index`` as a one-layer :class:`KVPool` (address it as layer 0)."""
        return KVPool(k=self.k[index], v=self.v[index])

    def replace_layer(self, index: int, pool: KVPool) -> LayeredKVPool:
        k, v = list(self.k), list(self.v)
        k[index], v[index] = pool.k, pool.v
        return LayeredKVPool(k=tuple(k), v=tuple(v))

    def read_blocks(self, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        return (jnp.concatenate([x[:, ids] for x in self.k]),
                jnp.concatenate([x[:, ids] for x in self.v]))

    def write_blocks(self, ids: jax.Array, k: jax.Array, v: jax.Array) -> LayeredKVPool:
        return LayeredKVPool(k=tuple(x.at[:, ids].set(k[i:i + 1]) for i, x in enumerate(self.k)),
                             v=tuple(x.at[:, ids].set(v[i:i + 1]) for i, x in enumerate(self.v)))



AnyKVPool = KVPool | LayeredKVPool


def copy_blocks(pool: AnyKVPool, src: jax.Array, dst: jax.Array) -> AnyKVPool:
    """Blocks ``src`` (i32[n]) copied onto ``dst`` in every layer, for either pool layout (block
    is axis 1 of every array). Padding pairs are (0, 0): the null block copied onto itself."""
    return jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), pool)


@flax.struct.dataclass
class BatchMetadata:
    """Everything one forward step needs besides params and the pool.

    T = padded token count, S = padded sequence count, W = padded block-table width,
    N = number of tokens whose logits are wanted.
    """

    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]   position of each token within its sequence
    slot_mapping: jax.Array  # i32[T]   pool slot to write each token's K/V (padding -> PAD_SLOT)
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
