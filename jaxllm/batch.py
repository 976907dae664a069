"""The per-step batch metadata the model forward reads, and the one function that builds it.

Tokens of all sequences in a step are flattened into one ragged axis ``T`` (padded to a
bucket). Sequence ``s`` owns the query tokens ``query_start_loc[s]:query_start_loc[s+1]``
and, in the KV pool (:mod:`jaxllm.kv_pool`), the blocks listed in ``block_tables[s]``::

    block_tables[s] = [7, 2, 9, 0, 0]        (0 = the reserved null block, used as padding)
    pool block 7: positions  0..15 of s
    pool block 2: positions 16..31 of s
    pool block 9: positions 32..47 of s      (partly filled: seq_lens[s] = 40)

A token at position p lives in slot ``block_tables[s][p // B] * B + p % B``; the slot mapping
tells the forward where to write each new token's K/V. Padded tokens have slot
``PAD_SLOT`` (-1): their writes are dropped, so block 0 stays zeros.

:func:`pack_batch` is the only builder of :class:`BatchMetadata`: the engine (numpy, on the
host, once per step), ``generate()`` (jax, inside its jit), the memory planner and the tests
all call it. It is written in array operations that numpy and jax.numpy share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kv_pool import NULL_BLOCK, PAD_SLOT


@flax.struct.dataclass
class BatchMetadata:
    """Everything one forward step needs besides params and the pool.

    T = padded token count, S = padded sequence count, W = padded block-table width,
    N = number of tokens whose logits are wanted.
    """

    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]   position of each token within its sequence
    slot_mapping: jax.Array  # i32[T]   pool slot to write each token's K/V (padding -> PAD_SLOT)
    block_tables: jax.Array  # i32[S, W] pool block ids per sequence (padding -> 0)
    seq_lens: jax.Array  # i32[S]   context length after this step (0 for padded sequences)
    query_start_loc: jax.Array  # i32[S + 1] start of each sequence's tokens in T (non-decreasing)
    logits_indices: jax.Array  # i32[N]   flat token indices whose logits are returned
    # Static: every sequence has one query token (picks the decode kernel). None: decided by
    # the shapes (T == S).
    decode_only: bool | None = flax.struct.field(pytree_node=False, default=None)


@flax.struct.dataclass
class PackedBatch:
    """A step's :class:`BatchMetadata` and placeholder rows in one int32 buffer, so that the
    engine makes one host-to-device copy a step instead of one per field; ``unpack`` slices
    it back inside the jitted step, where the slices cost nothing. The sizes are static (the
    step's bucket), so one layout compiles once.

    ``data`` (i32[4T + S*W + 2S + 1 + N]) holds, back to back: input_ids [T], positions [T],
    slot_mapping [T], prev_rows [T] (each token's row in the previous step's samples, or -1),
    block_tables [S*W], seq_lens [S], query_start_loc [S + 1], logits_indices [N].
    """

    data: jax.Array  # i32[4T + S*W + 2S + 1 + N]
    num_tokens: int = flax.struct.field(pytree_node=False)  # T
    num_seqs: int = flax.struct.field(pytree_node=False)  # S
    table_width: int = flax.struct.field(pytree_node=False)  # W
    num_logits: int = flax.struct.field(pytree_node=False)  # N
    decode_only: bool | None = flax.struct.field(pytree_node=False, default=None)

    @staticmethod
    def layout(t: int, s: int, w: int, n: int) -> tuple[tuple[str, int], ...]:
        """(field, length) in ``data``'s order: the one place it is written."""
        return (("input_ids", t), ("positions", t), ("slot_mapping", t), ("prev_rows", t),
                ("block_tables", s * w), ("seq_lens", s), ("query_start_loc", s + 1),
                ("logits_indices", n))

    @classmethod
    def pack(cls, batch: BatchMetadata, prev_rows: Any) -> PackedBatch:
        """``batch`` (numpy, as ``pack_batch`` gives it) and ``prev_rows`` (i32[T]) packed."""
        t, (s, w), n = batch.input_ids.shape[0], batch.block_tables.shape, \
            batch.logits_indices.shape[0]
        layout = cls.layout(t, s, w, n)
        data = np.empty(sum(size for _, size in layout), np.int32)
        offset = 0
        for name, size in layout:
            part = prev_rows if name == "prev_rows" else getattr(batch, name)
            data[offset:offset + size] = part.reshape(-1)
            offset += size
        return cls(data, t, s, w, n, batch.decode_only)

    def unpack(self) -> tuple[BatchMetadata, jax.Array]:
        """(the batch, prev_rows i32[T]): static slices of ``data`` (numpy or jax)."""
        t, s, w = self.num_tokens, self.num_seqs, self.table_width
        parts, offset = {}, 0
        for name, size in self.layout(t, s, w, self.num_logits):
            parts[name] = self.data[offset:offset + size]
            offset += size
        prev_rows = parts.pop("prev_rows")
        parts["block_tables"] = parts["block_tables"].reshape(s, w)
        return BatchMetadata(**parts, decode_only=self.decode_only), prev_rows

    def staged(self) -> PackedBatch:
        """The same batch with ``data`` copied, inside the jitted step, into a buffer of the
        program's own (among its temporaries), the copy fenced off from fusion so that every
        kernel reading the batch reads the copy. A step's batch arrives at a new device
        address every step, and XLA re-records each command of the step's CUDA graph that
        reads a moved buffer before the graph runs (~130 of a Llama-3-8B decode step's ~650:
        its KV writes and attention); read from the copy, only the copy's command is."""
        zero = jax.lax.optimization_barrier(jnp.zeros((), self.data.dtype))  # opaque to XLA
        return self.replace(data=jax.lax.optimization_barrier(self.data + zero))


@dataclasses.dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence this step, continuing after ``num_computed`` cached tokens."""

    token_ids: Sequence[int]
    num_computed: int
    block_table: Sequence[int]


@dataclasses.dataclass(frozen=True)
class SeqChunks:
    """C sequences' chunks as arrays (numpy on the host, jax inside a jit)."""

    token_ids: Any  # i32[sum n] the chunks' tokens back to back, or i32[C, P] one row each
    num_new_tokens: Any  # i32[C]  n: tokens of each chunk
    num_computed: Any  # i32[C]  tokens of each sequence already in the pool
    block_tables: Any  # i32[C, W'] each sequence's blocks (NULL_BLOCK padded)

    @classmethod
    def from_list(cls, chunks: Sequence[SeqChunk]) -> SeqChunks:
        width = max((len(c.block_table) for c in chunks), default=1)
        tables = np.full((len(chunks), width), NULL_BLOCK, np.int32)
        for i, c in enumerate(chunks):
            tables[i, :len(c.block_table)] = c.block_table
        tokens = [t for c in chunks for t in c.token_ids]
        return cls(np.asarray(tokens, np.int32),
                   np.asarray([len(c.token_ids) for c in chunks], np.int32),
                   np.asarray([c.num_computed for c in chunks], np.int32), tables)


def pack_batch(chunks: SeqChunks | Sequence[SeqChunk], block_size: int, *,
               num_tokens: int | None = None, num_seqs: int | None = None,
               table_width: int | None = None, logits_rows: Any = None,
               num_logits: int | None = None, all_logits: bool = False,
               decode_only: bool | None = None) -> BatchMetadata:
    """Flattens per-sequence chunks into one padded :class:`BatchMetadata`.

    Sizes (T = ``num_tokens``, S = ``num_seqs``, W = ``table_width``, N = ``num_logits``) are
    the bucket; each defaults to the exact size, larger values pad (padded tokens write
    nothing, padded sequences have no tokens). Logits: by default each chunk's last token;
    ``logits_rows`` (i32[R]) lists, per logits row, the chunk whose last token it reads (a
    chunk may be read by several rows: n > 1 samples of one prompt); ``all_logits``: every
    real token (host only). Arrays come back as numpy when ``chunks`` holds numpy arrays and
    as jax arrays otherwise; sizes must then be static.
    """
    if not isinstance(chunks, SeqChunks):
        chunks = SeqChunks.from_list(chunks)
    xp = np if isinstance(chunks.num_new_tokens, np.ndarray) else jnp
    i32 = lambda x: xp.asarray(x, xp.int32)
    num_new, num_computed = i32(chunks.num_new_tokens), i32(chunks.num_computed)
    given_tables = i32(chunks.block_tables)
    count = num_new.shape[0]  # C
    ends = xp.cumsum(num_new).astype(xp.int32)  # [C]
    starts = ends - num_new  # [C]
    total = ends[-1] if count else 0
    num_tokens = num_tokens or int(total)  # a static T is given inside a jit
    num_seqs = num_seqs or count
    width = table_width or given_tables.shape[1]
    if xp is np and (total > num_tokens or count > num_seqs or given_tables.shape[1] > width):
        raise ValueError(f"{total} tokens / {count} seqs / {given_tables.shape[1]} blocks "
                         f"exceed the bucket ({num_tokens} / {num_seqs} / {width})")

    tables = xp.full((num_seqs, width), NULL_BLOCK, xp.int32)  # [S, W]
    seq_lens = xp.zeros(num_seqs, xp.int32)  # [S]
    starts_padded = xp.full(num_seqs + 1, total, xp.int32)  # [S + 1]
    flat = xp.arange(num_tokens, dtype=xp.int32)  # [T]
    real = flat < total  # [T]
    if count:
        tables = _set(xp, tables, (slice(0, count), slice(0, given_tables.shape[1])),
                      given_tables)
        seq_lens = _set(xp, seq_lens, slice(0, count), num_computed + num_new)
        starts_padded = _set(xp, starts_padded, slice(0, count), starts)
        # traced (generate): unrolled, not jnp's default while loop, which XLA's GPU runtime
        # launches from the host outside the program's CUDA graph
        unrolled = {} if xp is np else {"method": "scan_unrolled"}
        seq = xp.minimum(xp.searchsorted(ends, flat, side="right", **unrolled), count - 1)  # [T]
        offset = flat - starts[seq]  # [T]  index of the token within its chunk
        pos = num_computed[seq] + offset  # [T]
        block_index = xp.clip(pos // block_size, 0, width - 1)
        slots = xp.where(real, tables[seq, block_index] * block_size + pos % block_size,
                         PAD_SLOT)
        if xp is np and real.any() and (pos[real] // block_size >= given_tables.shape[1]).any():
            s = int(seq[real][(pos[real] // block_size >= given_tables.shape[1])][0])
            raise ValueError(f"sequence {s}: {int(seq_lens[s])} tokens need more than "
                             f"{given_tables.shape[1]} blocks of {block_size}")
        tokens = i32(chunks.token_ids)
        if tokens.ndim == 2:  # one row per chunk
            ids = tokens[seq, xp.clip(offset, 0, tokens.shape[1] - 1)]
        else:
            ids = _set(xp, xp.zeros(num_tokens, xp.int32), slice(0, tokens.shape[0]),
                       tokens[:num_tokens])
        input_ids = xp.where(real, ids, 0)
        positions = xp.where(real, pos, 0)
    else:
        input_ids = positions = xp.zeros(num_tokens, xp.int32)
        slots = xp.full(num_tokens, PAD_SLOT, xp.int32)

    if all_logits:
        logits_at = np.arange(int(total), dtype=np.int32)
    elif logits_rows is None:
        logits_at = ends - 1 if count else xp.zeros(0, xp.int32)
    else:
        logits_at = (ends - 1)[i32(logits_rows)] if count else i32(logits_rows)
    num_logits = num_logits or logits_at.shape[0]
    logits_indices = _set(xp, xp.zeros(num_logits, xp.int32), slice(0, logits_at.shape[0]),
                          logits_at)
    return BatchMetadata(
        input_ids=input_ids, positions=positions, slot_mapping=slots, block_tables=tables,
        seq_lens=seq_lens, query_start_loc=starts_padded, logits_indices=logits_indices,
        decode_only=decode_only)


def _set(xp, array, index, values):
    """``array[index] = values`` for numpy (in place) or jax (a new array)."""
    if xp is np:
        array[index] = values
        return array
    return array.at[index].set(values)


def batch_spec(batch: BatchMetadata) -> BatchMetadata:
    """The same batch as ``jax.ShapeDtypeStruct`` leaves (for lowering without data)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)


__all__ = ["BatchMetadata", "PackedBatch", "SeqChunk", "SeqChunks", "batch_spec", "pack_batch"]
