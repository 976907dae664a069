"""Random paged-attention problems for kernel tests: permuted block tables, NaN-poisoned unused
pages and page tails, padded sequence slots and padding tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jaxllm.batch import BatchMetadata, SeqChunks, pack_batch

# Kernel vs reference on the same (rounded) inputs: max |diff| <= atol + rtol * |ref|.
TOLERANCES = {
    jnp.float32: dict(atol=2e-5, rtol=2e-5),
    jnp.float16: dict(atol=4e-3, rtol=4e-3),
    jnp.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@dataclasses.dataclass
class Case:
    args: tuple  # positional arguments of paged_attention_reference and the kernels
    batch: BatchMetadata  # the same step's metadata, as pack_batch builds it for the model
    num_real_tokens: int  # tokens past this are padding
    sliding_window: int | None
    scale: float


def make_case(chunks: Sequence[tuple[int, int]], *, block_size: int, num_q_heads: int,
              num_kv_heads: int, head_dim: int, dtype=jnp.float32, seed: int = 0,
              sliding_window: int | None = None, extra_tokens: int = 3, extra_seqs: int = 1,
              extra_width: int = 2, num_layers: int = 2, layer: int = 1) -> Case:
    """``chunks`` = (cached tokens, new query tokens) per sequence; the new tokens' K/V are
    already in the pool, as after the forward's write."""
    rng = np.random.default_rng(seed)
    totals = [c + n for c, n in chunks]
    pages = [-(-t // block_size) for t in totals]
    width = max(pages) + extra_width
    num_blocks = 1 + sum(pages) + 3  # null block + used + never-used
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape, np.float32)
    v = rng.standard_normal(shape, np.float32)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    num_seqs = len(chunks) + extra_seqs
    tables = np.zeros((num_seqs, width), np.int32)
    used = np.zeros(num_blocks, bool)
    for s, n in enumerate(pages):
        tables[s, :n] = [free.pop() for _ in range(n)]
        used[tables[s, :n]] = True
    # Unused blocks (the null block included) and every slot past a sequence's length: NaN.
    k[:, ~used] = v[:, ~used] = np.nan
    for s, total in enumerate(totals):
        for pos in range(total, pages[s] * block_size):
            blk = tables[s, pos // block_size]
            k[:, blk, pos % block_size] = v[:, blk, pos % block_size] = np.nan
    # The step's metadata as the engine packs it (padding tokens and sequence slots included).
    num_new = np.asarray([n for _, n in chunks], np.int32)
    num_real = int(num_new.sum())
    batch = pack_batch(
        SeqChunks(np.zeros(num_real, np.int32), num_new,
                  np.asarray([c for c, _ in chunks], np.int32), tables[:len(chunks)]),
        block_size, num_tokens=num_real + extra_tokens, num_seqs=num_seqs, table_width=width)
    q = rng.standard_normal((num_real + extra_tokens, num_q_heads, head_dim), np.float32)
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.int32(layer),
            jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens),
            jnp.asarray(batch.query_start_loc), jnp.asarray(batch.positions))
    return Case(args, batch, num_real, sliding_window, head_dim ** -0.5)


def decode_chunks(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """One query token at the end of each sequence."""
    return [(n - 1, 1) for n in lengths]
