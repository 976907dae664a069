"""The fast path of a float leaf's block: the Hugging Face tensors' rows moved to the device as
stored ([out, in], the checkpoint's dtype), then cast, fused and transposed there.

Why: assembling the blocks on the host (strided ``[out, in] -> [in, out]`` transposes and the
fused q/k/v, gate/up columns gathered by mask, one thread) was the HF load's whole cost: an
8B model took 53 s against 8.9 s from an orbax checkpoint of the same bytes
(benchmarks/RESULTS.md, issue 16). Here the host only slices rows, which for every block a
device holds under tensor parallelism (a column-parallel shard's heads or MLP slice) are one
contiguous span per source tensor, so the read is the mmap's own pages; the device does the
rest (a transpose is cheap there, and XLA's CPU transpose beats numpy's by ~4x too).
:meth:`jaxllm.loading.assemble.Leaf.read` is the same block made on the host: the spec.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Index = tuple[slice, ...]


def on_device(blocks: list[np.ndarray], order: np.ndarray | None, device: Any, dtype: Any,
              transpose: bool) -> jax.Array:
    """``blocks`` (host, [rows, ...]) joined on ``device`` (None: the default device), their
    rows taken in ``order`` (None: as joined), cast to ``dtype`` and, for a kernel,
    transposed to [in, out]."""
    parts = [jax.device_put(np.ascontiguousarray(b), device) for b in blocks]
    if len(parts) == 1 and order is None and not transpose and parts[0].dtype == dtype:
        return parts[0]
    return _assemble(parts, order, dtype=jnp.dtype(dtype), transpose=transpose)


@functools.partial(jax.jit, static_argnames=("dtype", "transpose"))
def _assemble(parts: list[jax.Array], order: jax.Array | None, *, dtype: Any,
              transpose: bool) -> jax.Array:
    x = parts[0] if len(parts) == 1 else jnp.concatenate(parts)  # [rows, in] or [rows]
    if order is not None:
        x = jnp.take(x, order, axis=0, mode="clip")  # the fused outputs' rows, in order
        if transpose:
            # NOTE: measured on CPU (8192 x 2048 bf16, gate/up): gathering the rows and then
            # transposing takes 130 ms; fused into one loop, 300 ms.
            x = jax.lax.optimization_barrier(x)
    x = x.astype(dtype)
    return x.T if transpose else x  # [in, out] or [out]


def fused_block(load: Callable[[str], np.ndarray], names: list[str],
                columns: tuple[np.ndarray, np.ndarray], idx: Index, device: Any, dtype: Any,
                *, bias: bool) -> jax.Array:
    """Block ``idx`` of a fused kernel [in, out] (or bias [out]) whose output ``columns``
    (part, row) come from the tensors ``names`` [out_part, in], made on ``device``. Each
    source's rows are read as one span, the span a tensor-parallel shard needs."""
    parts, rows = columns
    cols = np.arange(len(parts))[idx[-1]]
    blocks, order, offset = [], np.empty(len(cols), np.int32), 0
    for part, name in enumerate(names):
        mask = parts[cols] == part
        if not mask.any():
            continue
        need = rows[cols[mask]]
        lo, hi = int(need.min()), int(need.max()) + 1
        tensor = load(name)
        blocks.append(tensor[lo:hi] if bias else tensor[lo:hi, idx[0]])
        order[mask] = offset + need - lo
        offset += hi - lo
    return on_device(blocks, order, device, dtype, transpose=not bias)
