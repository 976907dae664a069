"""The one attention dispatch point: every model layer calls :func:`paged_attention` here.

``backend`` is a static choice made by the model's owner: "reference" (the float32 XLA
specification, any platform) or "auto" (the fastest implementation available on the current
platform; today that is the reference everywhere, the Pallas GPU kernels plug in here).
"""

from __future__ import annotations

import jax

from jaxllm.batch import BatchMetadata, KVPool
from pallas_kernels.paged_attention import paged_attention_reference

ATTENTION_BACKENDS = ("auto", "reference")


def resolve_backend(backend: str) -> str:
    """Maps "auto" to a concrete backend for the default platform."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} must be one of {ATTENTION_BACKENDS}")
    return "reference" if backend == "auto" else backend


def write_kv(kv_pool: KVPool, layer: jax.Array, slot_mapping: jax.Array, k: jax.Array,
             v: jax.Array) -> KVPool:
    """Scatters this step's keys/values ([T, Hkv, D]) into the pool at ``slot_mapping`` (i32[T])."""
    block_size = kv_pool.block_size
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    # NOTE: padded tokens all write to block 0; duplicate indices are fine, nobody reads it.
    return KVPool(
        k=kv_pool.k.at[layer, blocks, offsets].set(k.astype(kv_pool.k.dtype)),
        v=kv_pool.v.at[layer, blocks, offsets].set(v.astype(kv_pool.v.dtype)),
    )


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_pool: KVPool,  # this step's K/V already written
    layer: jax.Array,  # i32[]
    batch: BatchMetadata,
    *,
    scale: float,
    sliding_window: int | None,
    backend: str = "auto",
) -> jax.Array:  # [T, Hq, D]
    resolve_backend(backend)
    return paged_attention_reference(
        q, kv_pool.k, kv_pool.v, layer, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, batch.positions, scale=scale, sliding_window=sliding_window)


__all__ = ["ATTENTION_BACKENDS", "paged_attention", "resolve_backend", "write_kv"]
