"""Host-side packing of sequences into one padded :class:`BatchMetadata` (numpy in, jax out)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jaxllm.batch import NULL_BLOCK, PAD_SLOT, BatchMetadata


@dataclasses.dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence this step, continuing after ``num_computed`` cached tokens."""

    token_ids: Sequence[int]
    num_computed: int
    block_table: Sequence[int]


def pack_batch(chunks: Sequence[SeqChunk], block_size: int, *, num_tokens: int | None = None,
               num_seqs: int | None = None, table_width: int | None = None,
               all_logits: bool = False) -> BatchMetadata:
    """Flattens ``chunks`` into padded arrays.

    Logits are requested for each chunk's last token (``all_logits``: for every real token).
    Sizes default to the exact ones; larger values pad (padded tokens write nothing).
    """
    lens = [len(c.token_ids) for c in chunks]
    total = sum(lens)
    num_tokens = num_tokens or total
    num_seqs = num_seqs or len(chunks)
    width = table_width or max(len(c.block_table) for c in chunks)
    if total > num_tokens or len(chunks) > num_seqs:
        raise ValueError(f"{total} tokens / {len(chunks)} seqs exceed the bucket "
                         f"({num_tokens} / {num_seqs})")
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, PAD_SLOT, np.int32)
    tables = np.full((num_seqs, width), NULL_BLOCK, np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    starts = np.full(num_seqs + 1, total, np.int32)
    logits_at: list[int] = []
    offset = 0
    for s, chunk in enumerate(chunks):
        n = lens[s]
        pos = chunk.num_computed + np.arange(n)
        table = np.asarray(chunk.block_table, np.int32)
        if (pos[-1] // block_size) >= len(table):
            raise ValueError(f"sequence {s}: {pos[-1] + 1} tokens need more than "
                             f"{len(table)} blocks of {block_size}")
        input_ids[offset:offset + n] = chunk.token_ids
        positions[offset:offset + n] = pos
        slots[offset:offset + n] = table[pos // block_size] * block_size + pos % block_size
        tables[s, :len(table)] = table
        seq_lens[s] = chunk.num_computed + n
        starts[s] = offset
        logits_at.extend(range(offset, offset + n) if all_logits else [offset + n - 1])
        offset += n
    return BatchMetadata(
        input_ids=jnp.asarray(input_ids), positions=jnp.asarray(positions),
        slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(seq_lens), query_start_loc=jnp.asarray(starts),
        logits_indices=jnp.asarray(np.asarray(logits_at, np.int32)))
