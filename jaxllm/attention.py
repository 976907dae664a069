"""The one attention dispatch point: every model layer calls :func:`paged_attention` here.

``backend`` is a static choice made by the model's owner:

- "reference": the float32 XLA specification, any platform.
- "pallas": the Pallas (Triton) GPU kernels: the decode kernel for decode-only batches; for
  everything else the decode kernel for each sequence's last token and the prefill kernel for
  the rest (``paged_attention_mixed``). Shapes the kernels cannot tile (a head dim or block size
  that is not a power of two) use the reference.
- "pallas_interpret": the same kernels run by the Pallas interpreter (CPU tests).
- "pallas_mosaic": "pallas" with the Hopper prefill kernel (Pallas' Mosaic GPU backend: TMA,
  wgmma) in place of the Triton one wherever it takes the operands; needs compute capability
  9.0. "pallas_mosaic_interpret": the same on CPU (JAX's GPU interpreter runs the Hopper
  kernel).
- "auto": "pallas_mosaic" on a Hopper GPU, "pallas" on another GPU, "reference" elsewhere.
  On the H200 the Hopper kernel ran 2k-token chunks over 0 / 2k / 8k cached tokens at 1.5 /
  1.65 / 1.6x the Triton kernel's rate and the 8B offline run's mixed steps 2.5% faster; its
  programs take longer to compile (the offline run's cold start: ~60 s more).

Under tensor parallelism (a ``mesh`` with a ``tp`` axis) the K/V write and the attention run
per shard in ``jax.shard_map``: each device sees its own query and KV heads and its heads'
part of the pool, so the kernels and the reference are unchanged and nothing is communicated.
Inside a pipeline stage the same ``shard_map`` nests in the stage loop's, over ``tp`` alone.
"""

from __future__ import annotations

import os

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxllm.batch import BatchMetadata
from jaxllm.env_settings import env_switch
from jaxllm.kv_pool import KVPool, write_kv
from jaxllm.pallas_kernels.paged_attention import (
    kernels_support,
    paged_attention_decode,
    paged_attention_mixed,
    paged_attention_reference,
)
from jaxllm.pallas_kernels.paged_attention.rope_kv_write import rope_kv_write
from jaxllm.pallas_kernels.paged_attention.rope_kv_write import (
    unsupported as rope_kv_unsupported,
)
from jaxllm.parallel import PP_AXIS, TP_AXIS, pipeline_parallel_size, tensor_parallel_size
from jaxllm.parallel.sharding import KV_HEAD_AXIS

ATTENTION_BACKENDS = ("auto", "reference", "pallas", "pallas_interpret", "pallas_mosaic",
                      "pallas_mosaic_interpret")
HOPPER = "9.0"  # the compute capability "pallas_mosaic" compiles for (wgmma, TMA)


def resolve_backend(backend: str) -> str:
    """Maps "auto" to a concrete backend for the default platform; refuses one the default
    device cannot run."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} must be one of {ATTENTION_BACKENDS}")
    if backend == "auto":
        if jax.default_backend() != "gpu":
            return "reference"
        return "pallas_mosaic" if device_compute_capability() == HOPPER else "pallas"
    if backend in ("pallas", "pallas_mosaic") and jax.default_backend() != "gpu":
        raise ValueError(f"attention backend {backend!r} needs a GPU (this platform: "
                         f"{jax.default_backend()}); its interpreted form is "
                         f"{backend + '_interpret'!r}")
    if backend == "pallas_mosaic":
        capability = device_compute_capability()
        if capability != HOPPER:
            raise ValueError(f"attention backend 'pallas_mosaic' needs a Hopper GPU (compute "
                             f"capability {HOPPER}); this one has {capability}")
    return backend


def device_compute_capability() -> str | None:
    """The first device's CUDA compute capability ("9.0" on Hopper); None off CUDA."""
    return getattr(jax.devices()[0], "compute_capability", None)


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
    merge: bool = True,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [T, Hq, D]
    """``merge=False``: where the decode kernel splits the keys, its unmerged partials (o, lse)
    (``paged_attention_decode``'s), else the output as with ``merge``."""
    backend = resolve_backend(backend)
    args = (q, kv_pool.k, kv_pool.v, layer, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, batch.positions)
    if backend == "reference" or not kernels_support(q, kv_pool.k, kv_pool.v):
        return paged_attention_reference(*args, scale=scale, sliding_window=sliding_window)
    interpret = backend.endswith("_interpret")
    if is_decode_batch(q, batch):
        return paged_attention_decode(*args, scale=scale, sliding_window=sliding_window,
                                      interpret=interpret, merge=merge)
    return paged_attention_mixed(
        *args, scale=scale, sliding_window=sliding_window, interpret=interpret,
        prefill_kernel="mosaic" if backend.startswith("pallas_mosaic") else "triton")


def write_kv_and_attend(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    kv_pool: KVPool,
    layer: jax.Array,  # i32[]
    batch: BatchMetadata,
    *,
    scale: float,
    sliding_window: int | None,
    backend: str = "auto",
    mesh: Mesh | None = None,
    merge: bool = True,
) -> tuple[jax.Array, KVPool]:  # [T, Hq, D], the pool with this step's K/V written
    """Writes this step's K/V into layer ``layer`` of the pool, then attends; per shard of the
    head axis when ``mesh`` splits it (``merge=False``, :func:`paged_attention`'s, on one
    device only)."""

    def local(q, k, v, kv_pool, layer, batch):
        kv_pool = write_kv(kv_pool, layer, batch.slot_mapping, k, v)
        return paged_attention(q, kv_pool, layer, batch, scale=scale,
                               sliding_window=sliding_window, backend=backend,
                               merge=merge), kv_pool

    if tensor_parallel_size(mesh) == 1:
        return local(q, k, v, kv_pool, layer, batch)
    if not merge:
        raise ValueError("unmerged attention partials are for one device")
    heads = PartitionSpec(None, TP_AXIS, None)
    pool_spec = PartitionSpec(*([None] * KV_HEAD_AXIS), TP_AXIS, None)
    pool_specs = KVPool(k=pool_spec, v=pool_spec)
    manual = {}
    context = jax.sharding.get_abstract_mesh()
    if PP_AXIS in getattr(context, "manual_axes", ()):
        # Inside a pipeline stage (jaxllm.parallel.pipeline): ``pp`` is manual already.
        manual = dict(mesh=context, axis_names={TP_AXIS})
    return jax.shard_map(
        local, **({"mesh": mesh} | manual),
        in_specs=(heads, heads, heads, pool_specs, PartitionSpec(), PartitionSpec()),
        out_specs=(heads, pool_specs), check_vma=False)(q, k, v, kv_pool, layer, batch)


# JAXLLM_ROPE_KV_KERNEL (on by default; "off": XLA's passes): where the attention kernels run
# (a GPU, or interpreted) on one device, a step of at most ROPE_KV_KERNEL_MAX_TOKENS tokens
# rotates its queries and keys and writes its keys and values into the pool in one kernel
# (rope_kv_write.py) instead of XLA's three (two scatters and the queries' rotation): 31-63
# launches fewer a Llama-3-8B decode step; on an H100 (RESULTS.md, 2026-12-06) the one-row
# step's device time 5.730 -> 5.688 ms bf16, 2.863 -> 2.798 AWQ (fused). Read as the forward
# is traced (executable_cache.PROGRAM_ENV).
ROPE_KV_KERNEL_ENV = "JAXLLM_ROPE_KV_KERNEL"
ROPE_KV_KERNEL_MAX_TOKENS = 64  # decode and small steps, where launches weigh


def rope_kv_kernel_enabled(environ=os.environ) -> bool:
    """Whether ``JAXLLM_ROPE_KV_KERNEL`` is "on" (the default); a clear error for a value
    other than "on" or "off"."""
    return env_switch(environ, ROPE_KV_KERNEL_ENV, default="on")


def rope_kv_kernel_applies(qkv: jax.Array, kv_pool: KVPool, backend: str,
                           mesh: Mesh | None) -> bool:
    """Static: does :func:`rope_write_kv_and_attend` take the one-kernel path for this qkv
    [T, Hkv (G + 2) D] (``backend`` the model's attention backend)?"""
    backend = resolve_backend(backend)
    return (rope_kv_kernel_enabled() and backend != "reference"
            and tensor_parallel_size(mesh) == 1 and pipeline_parallel_size(mesh) == 1
            and qkv.shape[0] <= ROPE_KV_KERNEL_MAX_TOKENS
            and rope_kv_unsupported(qkv.shape, kv_pool.k.shape, qkv.dtype,
                                    kv_pool.dtype) is None)


def rope_write_kv_and_attend(
    qkv: jax.Array,  # [T, Hkv (G + 2) D] the fused projection's output, or f32[S, T, ..] its
    # split-K partials (qkv_dtype: the projection's output dtype)
    cos: jax.Array,  # f32[T, D]
    sin: jax.Array,  # f32[T, D]
    kv_pool: KVPool,
    layer: jax.Array,  # i32[]
    batch: BatchMetadata,
    *,
    scale: float,
    sliding_window: int | None,
    backend: str = "auto",
    merge: bool = True,
    qkv_dtype=None,
) -> tuple[jax.Array, KVPool]:  # [T, Hq, D], the pool with this step's K/V written
    """RoPE on the queries and keys, the keys and values written into layer ``layer`` of the
    pool (one kernel, which also sums split partials), then attention (``merge``:
    :func:`paged_attention`'s); where :func:`rope_kv_kernel_applies`."""
    q, k, v = rope_kv_write(qkv, cos, sin, kv_pool.k, kv_pool.v, layer, batch.slot_mapping,
                            interpret=resolve_backend(backend).endswith("_interpret"),
                            dtype=qkv_dtype)
    kv_pool = KVPool(k=k, v=v)
    return paged_attention(q, kv_pool, layer, batch, scale=scale, sliding_window=sliding_window,
                           backend=backend, merge=merge), kv_pool


__all__ = ["ATTENTION_BACKENDS", "HOPPER", "device_compute_capability", "is_decode_batch",
           "paged_attention", "resolve_backend", "rope_kv_kernel_applies",
           "rope_write_kv_and_attend", "write_kv_and_attend"]
