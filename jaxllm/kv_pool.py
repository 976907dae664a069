"""The paged KV pool: its two layouts, the per-step K/V write, and block copies.

The pool holds every sequence's keys and values in fixed-size blocks; a block table lists a
sequence's blocks in order (see :mod:`jaxllm.batch`). Block 0 is the reserved null block:
padding in block tables points at it and nothing is ever written there.

Two layouts, chosen by the one setting ``unroll_layers`` (which also decides the params'
layout, :meth:`jaxllm.LoadedModel.with_layer_layout`):

- scanned (``unroll_layers=False``): :class:`KVPool`, one array pair stacked on the layer axis,
  for a forward that scans one compiled layer body;
- unrolled (``unroll_layers=True``): :class:`LayeredKVPool`, one array pair per layer, for a
  forward that runs the layers as straight-line code, each updating its own arrays in place.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxllm.layers.fp8 import FP8_DTYPE, FP8_MAX
from jaxllm.parallel.mesh import pipeline_parallel_size
from jaxllm.parallel.sharding import kv_pool_shardings

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
    (a stacked pool is written, read, then written again by the next layer). With P pipeline
    stages (:mod:`jaxllm.parallel.pipeline`) array j holds layer j of every stage, [P, ...]
    split over them: L / P arrays, each stage's j-th layer on its own devices."""

    k: tuple[jax.Array, ...]  # L / P x [P, num_blocks, block_size, Hkv, D]   (P = 1 unstaged)
    v: tuple[jax.Array, ...]  # L / P x [P, num_blocks, block_size, Hkv, D]

    @property
    def num_layers(self) -> int:
        return sum(x.shape[0] for x in self.k)

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
              head_dim: int, dtype: jnp.dtype, stages: int = 1) -> LayeredKVPool:
        shape = (stages, num_blocks, block_size, num_kv_heads, head_dim)
        count = num_layers // stages
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(count)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(count)))

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
        """``k``, ``v`` [L, n, ...] in :meth:`read_blocks`' layer order."""
        s = self.k[0].shape[0]  # stages
        return LayeredKVPool(
            k=tuple(x.at[:, ids].set(k[i * s:(i + 1) * s]) for i, x in enumerate(self.k)),
            v=tuple(x.at[:, ids].set(v[i * s:(i + 1) * s]) for i, x in enumerate(self.v)))


AnyKVPool = KVPool | LayeredKVPool


def new_kv_pool(config, num_blocks: int, block_size: int, dtype: jnp.dtype, *,
                unroll_layers: bool, mesh=None) -> AnyKVPool:
    """A zeroed pool for ``config`` (a :class:`~jaxllm.ModelConfig`) in the layout that
    ``unroll_layers`` picks; the only place either pool type is chosen. With ``mesh`` it is made
    split on it (by KV head, and by layer over pipeline stages), never whole on one device."""
    def zeros():
        args = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                config.head_dim, dtype)
        if unroll_layers:
            return LayeredKVPool.zeros(*args, stages=pipeline_parallel_size(mesh))
        return KVPool.zeros(*args)

    if mesh is None:
        return zeros()
    return jax.jit(zeros, out_shardings=kv_pool_shardings(jax.eval_shape(zeros), mesh))()


def kv_block_bytes(config, block_size: int, dtype: jnp.dtype) -> int:
    """Device bytes of one block across all layers, K and V."""
    return (2 * config.num_hidden_layers * block_size * config.num_key_value_heads
            * config.head_dim * jnp.dtype(dtype).itemsize)


def write_kv(kv_pool: KVPool, layer: jax.Array, slot_mapping: jax.Array, k: jax.Array,
             v: jax.Array) -> KVPool:
    """Scatters this step's keys/values ([T, Hkv, D]) into layer ``layer`` of the pool at
    ``slot_mapping`` (i32[T]); slots ``PAD_SLOT`` write nothing."""
    block_size, num_blocks = kv_pool.block_size, kv_pool.num_blocks
    # NOTE: padded tokens aim past the pool and are dropped, rather than all writing one
    # null-block slot: on the H200, generate()'s padded prompts (most of a 64 x 1024 static
    # batch) cost ~24 s a batch more than unpadded ones, which points at those colliding writes
    # (inferred from the timings, not profiled). Each aims at a block of its own, so that no
    # two tokens share a slot and the scatter may say its indices are unique: XLA then stores
    # each row instead of updating it atomically.
    if slot_mapping.shape[0] == 1:
        # One row would be rewritten by XLA into a dynamic-update-slice, which cannot drop an
        # out-of-range write: it becomes a select reading the pool and the update, two kernels
        # each for K and V in place of one scatter (and twice the readers of the step's batch).
        # A dropped second row keeps it a scatter: 63 fewer launches in a Llama-3-8B batch-1
        # step compiled for the H200 (benchmarks/step_kernels.py).
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), PAD_SLOT, slot_mapping.dtype)])
        k, v = (jnp.concatenate([x, jnp.zeros_like(x)]) for x in (k, v))
    past_the_pool = num_blocks + jnp.arange(slot_mapping.shape[0], dtype=slot_mapping.dtype)
    blocks = jnp.where(slot_mapping < 0, past_the_pool, slot_mapping // block_size)
    offsets = slot_mapping % block_size
    write = lambda pool, x: pool.at[layer, blocks, offsets].set(
        to_pool_dtype(x, kv_pool.dtype), mode="drop", unique_indices=True)
    return KVPool(k=write(kv_pool.k, k), v=write(kv_pool.v, v))


FP8_KV_CACHE_DTYPES = {"fp8": FP8_DTYPE, "fp8_e4m3": FP8_DTYPE}


def to_pool_dtype(x: jax.Array, dtype) -> jax.Array:
    """``x`` as the pool stores it. An FP8 pool (``--kv-cache-dtype fp8``) stores K and V with
    a scale of 1, as vLLM does without calibrated scales, saturating at e4m3's largest value
    (a plain cast would make anything past it NaN)."""
    if jnp.dtype(dtype) == jnp.dtype(FP8_DTYPE):
        x = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    return x.astype(dtype)


def kv_cache_dtype(name: str, model_dtype) -> jnp.dtype:
    """The pool's dtype for ``--kv-cache-dtype`` ``name``: "auto" is the model's dtype."""
    if name == "auto":
        return jnp.dtype(model_dtype)
    if name not in FP8_KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name}: must be one of auto, "
                         f"{', '.join(FP8_KV_CACHE_DTYPES)}")
    return jnp.dtype(FP8_KV_CACHE_DTYPES[name])


def copy_blocks(pool: AnyKVPool, src: jax.Array, dst: jax.Array) -> AnyKVPool:
    """Blocks ``src`` (i32[n]) copied onto ``dst`` in every layer, for either layout (block is
    axis 1 of every array). Padding pairs are (0, 0): the null block copied onto itself."""
    return jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), pool)


__all__ = ["FP8_KV_CACHE_DTYPES", "NULL_BLOCK", "PAD_SLOT", "AnyKVPool", "KVPool",
           "LayeredKVPool", "copy_blocks", "kv_block_bytes", "kv_cache_dtype", "new_kv_pool",
           "to_pool_dtype", "write_kv"]
