"""Paged attention: queries of a ragged batch against each sequence's blocks in the KV pool."""

from pallas_kernels.paged_attention.reference import paged_attention_reference

__all__ = ["paged_attention_reference"]
