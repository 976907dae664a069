"""Attention kernels over the paged KV pool, each beside its float32 XLA reference."""
