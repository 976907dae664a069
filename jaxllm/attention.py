"""The one attention dispatch point: every model layer calls :func:`paged_attention` here.

``backend`` is a static choice made by the model's owner:

- "reference": the float32 XLA specification, any platform.
- "pallas": the Pallas (Triton) GPU kernels: the decode kernel for decode-only batches; for
  everything else the decode kernel for each sequence's last token and the prefill kernel for
  the rest (``paged_attention_mixed``). Shapes the kernels cannot tile (a head dim or block size
  that is not a power of two) use the reference.
- "pallas_interpret": the same kernels run by the Pallas interpreter (CPU tests).
- "auto": "pallas" on GPU, "reference" elsewhere.
"""

from __future__ import annotations

import jax

from jaxllm.batch import BatchMetadata
from jaxllm.kv_pool import KVPool
from jaxllm.pallas_kernels.paged_attention import (
    kernels_support,
    paged_attention_decode,
    paged_attention_mixed,
    paged_attention_reference,
)

ATTENTION_BACKENDS = ("auto", "reference", "pallas", "pallas_interpret")


def resolve_backend(backend: str) -> str:
    """Maps "auto" to a concrete backend for the default platform."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} must be one of {ATTENTION_BACKENDS}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return backend


def is_decode_batch(q: jax.Array, batch: BatchMetadata) -> bool:
    """Static: does every sequence slot have exactly one query token?

    A static ``decode_only`` field on the batch wins when present; otherwise the shape
    relation T == S (the engine's decode buckets) decides. A mixed batch that happens to have
    T == S still gets correct results from the decode kernel, only slower: each of its prompt
    tokens reads the sequence's context once.
    """
    flag = getattr(batch, "decode_only", None)
    if flag is not None:
        return bool(flag)
    return q.shape[0] == batch.block_tables.shape[0]


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
    backend = resolve_backend(backend)
    args = (q, kv_pool.k, kv_pool.v, layer, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, batch.positions)
    if backend == "reference" or not kernels_support(q, kv_pool.k, kv_pool.v):
        return paged_attention_reference(*args, scale=scale, sliding_window=sliding_window)
    kernel = paged_attention_decode if is_decode_batch(q, batch) else paged_attention_mixed
    return kernel(*args, scale=scale, sliding_window=sliding_window,
                  interpret=backend == "pallas_interpret")


__all__ = ["ATTENTION_BACKENDS", "is_decode_batch", "paged_attention", "resolve_backend"]
