"""Paged attention: queries of a ragged batch against each sequence's blocks in the KV pool.

Every implementation has the signature of :func:`paged_attention_reference` (the spec):
:func:`paged_attention_decode` (one query token per sequence, split-K) and
:func:`paged_attention_prefill` (chunks of query tokens, causal over cached pages) are Pallas
kernels for the Triton GPU backend; :func:`paged_attention_mixed` runs both over one batch
(decodes and last tokens through the first, the rest through the second); pass
``interpret=True`` to run them on CPU. ``rope_kv_write.py`` turns a small step's fused qkv
row into their inputs (RoPE on q and k, K/V written into the pool) in one kernel.
"""

from .common import is_fp8, kernels_support
from .decode import DecodeConfig, paged_attention_decode
from .mixed import paged_attention_mixed
from .prefill import PrefillConfig, paged_attention_prefill
from .reference import paged_attention_reference

__all__ = ["DecodeConfig", "PrefillConfig", "is_fp8", "kernels_support", "paged_attention_decode",
           "paged_attention_mixed", "paged_attention_prefill", "paged_attention_reference"]
