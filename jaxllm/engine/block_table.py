"""Every sequence's GPU block ids as a row of one numpy array, kept up to date incrementally.

Plain numpy, no ``jax``. The block manager writes a row only where a table changes (a new
block every ``block_size`` tokens, a copy-on-write, a fork, a swap, a free), so that a step's
block tables are one fancy-indexed gather (``gather``) instead of a Python list per sequence
rebuilt every step::

    ids      row 0: [ 7  2  9  0  0 ...]   seq 12, 3 blocks     lengths[0] = 3
             row 1: [ 4  0  0  0  0 ...]   seq 15, 1 block      lengths[1] = 1
             row 2: [ 0  0  0  0  0 ...]   free row
    rows     {12: 0, 15: 1}

Columns past a row's length hold the null block (0), as the step's padded block tables must.
Rows and columns grow by doubling as needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NULL_BLOCK = 0  # the GPU pool's reserved block (jaxllm.kv_pool.NULL_BLOCK, without its jax)


class BlockTables:
    def __init__(self, num_rows: int = 64, num_cols: int = 16) -> None:
        self.ids = np.full((num_rows, num_cols), NULL_BLOCK, np.int32)  # i32[rows, cols]
        self.lengths = np.zeros(num_rows, np.int32)  # i32[rows] blocks in each row
        self.rows: dict[int, int] = {}  # seq id -> row
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: row 0 first

    def row(self, seq_id: int) -> int:
        """The seq's row, taken (empty) on first use."""
        row = self.rows.get(seq_id)
        if row is None:
            if not self._free_rows:
                self._grow_rows()
            row = self.rows[seq_id] = self._free_rows.pop()
        return row

    def write(self, seq_id: int, start: int, block_ids: Sequence[int]) -> None:
        """Sets the seq's blocks ``start:`` to ``block_ids`` (its length becomes
        ``start + len(block_ids)``)."""
        row = self.row(seq_id)
        end = start + len(block_ids)
        if end > self.ids.shape[1]:
            self._grow_cols(end)
        old = int(self.lengths[row])
        if end < old:
            self.ids[row, end:old] = NULL_BLOCK
        self.ids[row, start:end] = block_ids
        self.lengths[row] = end

    def set(self, seq_id: int, index: int, block_id: int) -> None:
        """Replaces one existing block id (copy-on-write)."""
        self.ids[self.rows[seq_id], index] = block_id

    def copy(self, src_seq_id: int, dst_seq_id: int) -> None:
        src, dst = self.rows[src_seq_id], self.row(dst_seq_id)
        self.ids[dst] = self.ids[src]
        self.lengths[dst] = self.lengths[src]

    def clear(self, seq_id: int) -> None:
        """Empties the seq's row and keeps it (a swapped-out seq)."""
        row = self.rows.get(seq_id)
        if row is not None:
            self.ids[row, :self.lengths[row]] = NULL_BLOCK
            self.lengths[row] = 0

    def remove(self, seq_id: int) -> None:
        """Empties the seq's row and frees it."""
        self.clear(seq_id)
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)

    def gather(self, seq_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The seqs' tables as (i32[C, W] block ids, null-padded, W = the longest;
        i32[C] lengths); a copy."""
        rows = np.fromiter(map(self.rows.__getitem__, seq_ids), np.intp, len(seq_ids))
        lengths = self.lengths[rows]
        width = max(1, int(lengths.max())) if len(rows) else 1
        return self.ids[rows, :width], lengths

    def table(self, seq_id: int) -> list[int]:
        row = self.rows.get(seq_id)
        return [] if row is None else self.ids[row, :self.lengths[row]].tolist()

    def _grow_rows(self) -> None:
        old = self.ids.shape[0]
        self.ids = np.concatenate([self.ids, np.full_like(self.ids, NULL_BLOCK)])
        self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
        self._free_rows = list(range(2 * old - 1, old - 1, -1))

    def _grow_cols(self, needed: int) -> None:
        cols = self.ids.shape[1]
        while cols < needed:
            cols *= 2
        grown = np.full((self.ids.shape[0], cols), NULL_BLOCK, np.int32)
        grown[:, :self.ids.shape[1]] = self.ids
        self.ids = grown
