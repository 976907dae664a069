"""Swapping: a preempted group's KV blocks parked in the CPU pool, and brought back.

The V0 feature vLLM's V1 KV-cache manager dropped, kept for preemption by SWAP (the scheduler's
choice for parallel-sampling groups). ``swap_out`` copies each distinct GPU block of the group
once into a CPU block, carrying over sharing inside the group (two forked sequences sharing a
block share its CPU copy), and releases the GPU blocks; ``swap_in`` does the reverse into fresh
GPU blocks. Apart from :mod:`jaxllm.engine.block_manager` because allocation, prefix caching
and fork never look at the CPU pool: only these methods and the consistency checks do.

A mixin of :class:`~jaxllm.engine.block_manager.BlockManager` rather than functions: the swap
methods are the manager's public API (the scheduler and the tests call them on it) and work on
its per-sequence tables, annotated on the class. Plain Python, no ``jax``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxllm.engine.block_manager import _SeqBlocks
    from jaxllm.engine.block_pool import BlockPool, KVCacheBlock
    from jaxllm.engine.block_table import BlockTables


class BlockSwapping:
    """Swap-out and swap-in of sequences' blocks between ``gpu_pool`` and ``cpu_pool``."""

    gpu_pool: BlockPool
    cpu_pool: BlockPool
    tables: BlockTables  # the numpy mirror of the GPU tables
    _seqs: dict[int, _SeqBlocks]
    _gpu_seq: Callable[[int], _SeqBlocks]  # the manager's: raises unless the seq is on the GPU

    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        return len(self._distinct_blocks(seq_ids, swapped=False)) <= self.cpu_pool.num_free_blocks

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move the seqs' GPU blocks to CPU blocks; returns (gpu_block, cpu_block) copies.

        A block shared inside the group is copied once and stays shared on the CPU side. The GPU
        references are released as in ``free``, so the caller must copy device->host before any
        later copy or forward of the same step writes to those GPU blocks.
        """
        owners = self._distinct_blocks(seq_ids, swapped=False)
        if len(owners) > self.cpu_pool.num_free_blocks:
            raise ValueError(
                f"swap_out needs {len(owners)} CPU blocks, {self.cpu_pool.num_free_blocks} free: "
                "increase the swap space"
            )
        mapping = self._copy_blocks(owners, self.cpu_pool)
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            seq.cpu_table = [mapping[b] for b in seq.table]
            self.gpu_pool.free_blocks(reversed(seq.table))
            seq.table = []
            self.tables.clear(seq_id)
        return [(g.block_id, c.block_id) for g, c in mapping.items()]

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool:
        return len(self._distinct_blocks(seq_ids, swapped=True)) <= self.gpu_pool.num_free_blocks

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move swapped-out seqs back to fresh GPU blocks; returns (cpu_block, gpu_block) copies."""
        owners = self._distinct_blocks(seq_ids, swapped=True)
        if len(owners) > self.gpu_pool.num_free_blocks:
            raise ValueError(
                f"swap_in needs {len(owners)} GPU blocks, {self.gpu_pool.num_free_blocks} free"
            )
        mapping = self._copy_blocks(owners, self.gpu_pool)
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            seq.table = [mapping[c] for c in seq.cpu_table]
            self.tables.write(seq_id, 0, [b.block_id for b in seq.table])
            self.cpu_pool.free_blocks(reversed(seq.cpu_table))
            seq.cpu_table = None
        return [(c.block_id, g.block_id) for c, g in mapping.items()]

    def _distinct_blocks(
        self, seq_ids: Sequence[int], *, swapped: bool
    ) -> collections.Counter[KVCacheBlock]:
        """Block -> number of owners among ``seq_ids``, in first-seen order."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate seq ids in {list(seq_ids)}")
        owners: collections.Counter[KVCacheBlock] = collections.Counter()
        for seq_id in seq_ids:
            if swapped:
                seq = self._seqs.get(seq_id)
                if seq is None or seq.cpu_table is None:
                    raise ValueError(f"seq {seq_id} is not swapped out")
                owners.update(seq.cpu_table)
            else:
                owners.update(self._gpu_seq(seq_id).table)
        return owners

    @staticmethod
    def _copy_blocks(
        owners: collections.Counter[KVCacheBlock], dst_pool: BlockPool
    ) -> dict[KVCacheBlock, KVCacheBlock]:
        """One fresh ``dst_pool`` block per source block, with the group's sharing carried over."""
        mapping = {}
        for src, dst in zip(owners, dst_pool.get_new_blocks(len(owners)), strict=True):
            dst.ref_cnt = owners[src]
            mapping[src] = dst
        return mapping
