"""Which 4-bit weight layouts the engine keeps: ``JAXLLM_INT4_HOPPER=auto`` resolved for the
model and the device it runs on.

"both" (the packed words for the one-row GEMV, an N-major copy for the Hopper kernel's 17-512
rows; :mod:`jaxllm.layers.linear`) costs the 4-bit weights' bytes a second time, taken from the
KV cache. "auto" keeps the copy only where the kernel runs (a Hopper GPU, one device, the
unrolled layers) and the copy is small beside the card: Llama-3-8B's 3.5 GB is 2.5% of an
H200 (4.4% of an H100), Llama-3-70B's 35 GB a quarter of an H200 (:data:`AUTO_COPY_MAX_SHARE`).
"""

from __future__ import annotations

import logging

import jax

from jaxllm import attention
from jaxllm.engine.device_memory import stored_bytes
from jaxllm.engine.kv_sizing import model_device, total_device_memory
from jaxllm.layers.linear import Int4Weight
from jaxllm.loading import LoadedModel

logger = logging.getLogger(__name__)

# The largest N-major copy "auto" keeps, as a share of the device's memory. A chosen bound,
# not a measured break-even: it admits the 7-8B models (3.5 GB: 4.4% of an H100, 2.5% of an
# H200) and refuses the 70B on one card, where its 35 GB would take ~40% of the KV cache.
AUTO_COPY_MAX_SHARE = 1 / 16


def n_major_copy_bytes(params) -> int:
    """Bytes an N-major copy of every one-layer 4-bit weight would take (as many as the packed
    words: 4 bits a weight either way)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int4Weight))
    return sum(stored_bytes(leaf.qweight) for leaf in leaves
               if isinstance(leaf, Int4Weight) and leaf.qweight.ndim == 2)


def auto_int4_layout_refusal(model: LoadedModel, device_memory: float | None,
                             compute_capability: str | None) -> str | None:
    """Why "auto" keeps the packed words only for the 4-bit ``model`` on this device; None:
    it keeps both layouts."""
    if compute_capability != attention.HOPPER:
        return f"not a Hopper GPU (compute capability {compute_capability})"
    if model.tensor_parallel_size * model.pipeline_parallel_size > 1:
        return "more than one device"
    if not model.unroll_layers:
        return "stacked layers"
    copy = n_major_copy_bytes(model.params)
    if device_memory is None or copy > device_memory * AUTO_COPY_MAX_SHARE:
        return (f"the N-major copy ({copy / 2**30:.1f} GiB) is more than "
                f"1/{round(1 / AUTO_COPY_MAX_SHARE)} of the device's memory")
    return None


def resolve_int4_layout(mode: str, model: LoadedModel, device_memory: float | None,
                        compute_capability: str | None) -> tuple[str, str | None]:
    """``mode`` ("off", "on", "both" or "auto") as the concrete layout to build, and, where
    "auto" kept a 4-bit model's packed words only, why (None otherwise); on a device with
    ``device_memory`` bytes (None: unknown) and ``compute_capability`` (None: not CUDA)."""
    if mode != "auto":
        return mode, None
    if not model.has_int4_weights:
        return "off", None  # no 4-bit weights: nothing to lay out
    refusal = auto_int4_layout_refusal(model, device_memory, compute_capability)
    return ("off" if refusal else "both"), refusal


def with_int4_layout(model: LoadedModel, mode: str, *, donate: bool = False) -> LoadedModel:
    """``model`` with the 4-bit layouts ``mode`` (``JAXLLM_INT4_HOPPER``) resolves to on its
    device, as the engine and the benchmarks that time its steps build them; ``donate`` as
    :meth:`LoadedModel.with_int4_n_major`."""
    layout, kept_packed_only = resolve_int4_layout(
        mode, model, total_device_memory(model_device(model)),
        attention.device_compute_capability())
    if kept_packed_only:
        logger.info("4-bit weights: packed words only (%s)", kept_packed_only)
    elif layout == "both" and model.has_int4_weights:
        logger.info("4-bit weights: packed words and an N-major copy for the Hopper kernel "
                    "(+%.2f GiB)", n_major_copy_bytes(model.params) / 2**30)
    return model.with_int4_n_major(layout, donate=donate)


__all__ = ["AUTO_COPY_MAX_SHARE", "auto_int4_layout_refusal", "n_major_copy_bytes",
           "resolve_int4_layout", "with_int4_layout"]
