"""Paged attention for batches that mix prompt chunks with decodes: the decode kernel takes
every sequence's last query token (a decode's only one), the prefill kernel the other tokens.

The prefill kernel gives each program up to ``block_q`` tokens of one sequence; a decode fills
one token's rows of that tile and still pays the whole tile's matmuls over its context. In an
engine step of ~256 decodes plus a few prompt chunks the decodes would then cost most of the
step's attention; the decode kernel reads the same keys once per token with no tile to fill.

``prefill_kernel`` picks the other tokens' kernel: "triton" (:func:`paged_attention_prefill`,
any GPU) or "mosaic" (:func:`paged_attention_prefill_hopper`: TMA and wgmma, Hopper only),
which falls back to "triton" for operands it does not take (``hopper_unsupported``: an FP8
pool, a sliding window, a head dim that is not a multiple of 64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .decode import DecodeConfig, paged_attention_decode
from .prefill import PrefillConfig, paged_attention_prefill
from .prefill_hopper import paged_attention_prefill_hopper
from .prefill_hopper_config import HopperPrefillConfig
from .prefill_hopper_config import unsupported as hopper_unsupported

PREFILL_KERNELS = ("triton", "mosaic")


def place_rows(out: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """``out`` ([T, ...]) with ``values[i]`` at row ``rows[i]``; rows < 0 write nothing. Those
    aim past the end, each at a row of its own, so that the rows are unique and XLA stores
    them rather than updating them atomically."""
    past_the_end = out.shape[0] + jnp.arange(rows.shape[0], dtype=rows.dtype)
    return out.at[jnp.where(rows >= 0, rows, past_the_end)].set(values, mode="drop",
                                                                unique_indices=True)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "decode_config",
                                             "prefill_config", "prefill_kernel", "interpret"))
def paged_attention_mixed(
    q: jax.Array,  # [T, Hq, D]
    k_pool: jax.Array,  # [L, num_blocks, block_size, Hkv, D]
    v_pool: jax.Array,  # [L, num_blocks, block_size, Hkv, D]
    layer: jax.Array | int,  # i32[]
    block_tables: jax.Array,  # i32[S, W]
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    positions: jax.Array,  # i32[T]
    *,
    scale: float,
    sliding_window: int | None = None,
    decode_config: DecodeConfig | None = None,
    prefill_config: PrefillConfig | HopperPrefillConfig | None = None,
    prefill_kernel: str = "triton",
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D] in q.dtype
    """Same contract as :func:`paged_attention_reference`; any mix of chunks and decodes."""
    if prefill_kernel not in PREFILL_KERNELS:
        raise ValueError(f"prefill_kernel={prefill_kernel!r} must be one of {PREFILL_KERNELS}")
    num_tokens = q.shape[0]
    num_seqs = seq_lens.shape[0]
    last = query_start_loc[1:] - 1  # [S] each sequence's last query token
    has_tokens = last >= query_start_loc[:-1]  # [S] empty slots (padding) have none
    last_token = jnp.clip(last, 0, num_tokens - 1)
    decoded = paged_attention_decode(  # [S, Hq, D]: one query token per sequence
        q[last_token], k_pool, v_pool, layer, block_tables,
        jnp.where(has_tokens, seq_lens, 0), jnp.arange(num_seqs + 1, dtype=jnp.int32),
        positions[last_token], scale=scale, sliding_window=sliding_window,
        config=decode_config, interpret=interpret)
    prefill = paged_attention_prefill
    if prefill_kernel == "mosaic":
        hopper_config = prefill_config or HopperPrefillConfig()
        if not isinstance(hopper_config, HopperPrefillConfig):
            raise ValueError(f"prefill_kernel='mosaic' takes a HopperPrefillConfig, not "
                             f"{type(hopper_config).__name__}")
        if hopper_unsupported(q, k_pool, sliding_window, hopper_config) is None:
            prefill, prefill_config = paged_attention_prefill_hopper, hopper_config
        else:
            prefill_config = None  # the Triton kernel's own default
    rest = prefill(
        q, k_pool, v_pool, layer, block_tables, seq_lens, query_start_loc, positions,
        scale=scale, sliding_window=sliding_window, config=prefill_config,
        interpret=interpret, skip_single_token_seqs=True)
    return place_rows(rest, jnp.where(has_tokens, last, -1), decoded)
