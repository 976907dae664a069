"""KV block manager: per-sequence block tables over the GPU pool, prefix caching, fork/COW, swap.

The vLLM-V1 KV-cache manager (``allocate_slots`` / ``free`` over a :class:`BlockPool` with a
``block_hash`` map) plus the V0 features V1 dropped: fork with copy-on-write for parallel sampling
and swapping sequences out to a CPU pool (:mod:`jaxllm.engine.block_swap`). Plain Python, no
``jax``; sequences are integer ids.

    block_size 4, seq 7 with 10 tokens (8 computed, 2 scheduled now):

    token_ids     t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  .
    block_table   [    3      ,     9       ,    4      ]      GPU block ids
    block_hashes  [    h0     ,     h1      ]                  full blocks only, a chain:
                  h0 = hash(None, t0..t3)   h1 = hash(h0, t4..t7)

    Token p lives in slot p % block_size of block block_table[p // block_size]
    (slot_mapping[p] = block_table[p // block_size] * block_size + p % block_size).

    fork(7, 8) shares every block (ref_cnt 2). The next allocate_slots that writes into a shared
    block gives the writer a fresh copy:   seq 8: [3, 9, 4] -> [3, 9, 11], returns [(4, 11)].

Per scheduling pass the scheduler calls, for a new sequence, ``lookup_prefix`` and then
``allocate_slots`` with the hit blocks; for a running one ``allocate_slots`` alone. The copies
the manager returns must all run on the device before the step's forward, in the order the calls
returned them (safe batched order: swap-out, swap-in, COW; V0 never swaps in and out in the same
step, and a swap-in must not read CPU blocks that a later swap-out in the same step overwrites).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from jaxllm.engine.block_pool import (
    HASH_ALGOS,
    BlockHash,
    BlockPool,
    KVCacheBlock,
    hash_block_tokens,
)
from jaxllm.engine.block_swap import BlockSwapping
from jaxllm.engine.block_table import BlockTables


@dataclasses.dataclass(slots=True)
class _SeqBlocks:
    table: list[KVCacheBlock]  # GPU blocks in position order; empty while swapped out
    # Hash chain of the seq's first len() full blocks: those already offered to the prefix cache.
    # Kept across swaps so new full blocks keep chaining from the right parent.
    block_hashes: list[BlockHash]
    cpu_table: list[KVCacheBlock] | None = None  # CPU blocks while swapped out


def _cacheable(num_tokens: int, num_cacheable_tokens: int | None) -> int:
    """How many of a sequence's first ``num_tokens`` may enter the prefix cache."""
    return num_tokens if num_cacheable_tokens is None else min(num_tokens, num_cacheable_tokens)


class BlockManager(BlockSwapping):
    """Block tables for integer seq ids over a GPU pool (block 0 = null block) and a CPU pool."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        prefix_caching_hash_algo: str = "builtin",
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"{num_gpu_blocks=} must be >= 2 (block 0 is the null block)")
        if block_size < 1:
            raise ValueError(f"{block_size=} must be >= 1")
        if num_cpu_blocks < 0:
            raise ValueError(f"{num_cpu_blocks=} must be >= 0")
        if prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"{prefix_caching_hash_algo=} must be one of {HASH_ALGOS}")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = prefix_caching_hash_algo
        self.gpu_pool = BlockPool(num_gpu_blocks, reserve_null_block=True)
        self.cpu_pool = BlockPool(num_cpu_blocks, reserve_null_block=False)
        self.prefix_cache_queries = 0  # tokens looked up (vllm:prefix_cache_queries)
        self.prefix_cache_hits = 0  # of those, tokens found cached (vllm:prefix_cache_hits)
        self._seqs: dict[int, _SeqBlocks] = {}
        # The same GPU tables as numpy rows, written where they change: a step's tables are
        # one gather (block_tables) instead of a list per sequence rebuilt every step.
        self.tables = BlockTables()
        # Prefix caching: seq id -> the known-token count at which its next block is full and
        # gets registered. Below it, one token into the seq's own unshared last block changes
        # nothing, which the scheduler checks without calling allocate_slots.
        self.register_at: dict[int, int] = {}

    # ---- accounting ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """GPU blocks allocatable now: free blocks plus evictable cached blocks (ref_cnt 0)."""
        return self.gpu_pool.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable GPU blocks with ref_cnt > 0 (vllm:kv_cache_usage_perc)."""
        return self.gpu_pool.usage

    @property
    def cpu_usage(self) -> float:
        return self.cpu_pool.usage

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the seq's GPU block ids ([] for an unknown or swapped-out seq)."""
        seq = self._seqs.get(seq_id)
        return [b.block_id for b in seq.table] if seq is not None else []

    def block_tables(self, seq_ids: Sequence[int]):
        """The seqs' GPU tables as (i32[C, W] block ids, null-padded to the longest; i32[C]
        lengths): numpy copies."""
        return self.tables.gather(seq_ids)

    def num_table_blocks(self) -> int:
        """Block-table slots of every seq with GPU blocks (a block shared by k seqs: k)."""
        return int(self.tables.lengths.sum())

    def num_blocks(self, seq_id: int) -> int:
        """len(block_table(seq_id)), without building the copy."""
        seq = self._seqs.get(seq_id)
        return len(seq.table) if seq is not None else 0

    def has_seq(self, seq_id: int) -> bool:
        """True while the manager holds blocks for the seq, on the GPU or swapped out."""
        return seq_id in self._seqs

    def is_swapped(self, seq_id: int) -> bool:
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.cpu_table is not None

    # ---- prefix cache + allocation ---------------------------------------------------------------

    def lookup_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Longest chain of cached full blocks that prefixes ``token_ids``.

        Capped at (len(token_ids) - 1) // block_size blocks so at least one token is left to
        compute (the forward must produce logits for the last token). Returns (block_ids,
        num_cached_tokens); changes nothing but the query/hit counters; ([], 0) when caching is off.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        block_ids: list[int] = []
        parent: BlockHash | None = None
        for i in range(max(0, (len(token_ids) - 1) // bs)):
            parent = hash_block_tokens(self.hash_algo, parent, token_ids[i * bs : (i + 1) * bs])
            block = self.gpu_pool.get_cached_block(parent)
            if block is None:
                break
            block_ids.append(block.block_id)
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += len(block_ids) * bs
        return block_ids, len(block_ids) * bs

    def allocate_slots(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: Sequence[int] = (),
        num_cacheable_tokens: int | None = None,
    ) -> list[tuple[int, int]] | None:
        """Make the seq's block table cover num_computed_tokens + num_new_tokens tokens.

        ``num_cacheable_tokens`` caps which blocks get registered in the prefix cache: tokens
        past it are placeholders (sampled on the device, not yet known on the host); their
        blocks are registered by a later call once the tokens are real.

        ``token_ids`` is the seq's full token list (prompt + outputs so far). For a seq without a
        table, ``cached_blocks`` from ``lookup_prefix`` in the same pass are attached first
        (touched). An existing block that the new tokens write into and that is shared (ref_cnt
        > 1, after ``fork``) is replaced by a fresh block: copy-on-write. Returns the (src, dst)
        block copies to run before the forward (usually []), or None, changing nothing, when
        there are not enough free GPU blocks. With prefix caching on, every block full once
        token_ids[:num_computed_tokens + num_new_tokens] are written is registered.
        """
        bs = self.block_size
        num_tokens = num_computed_tokens + num_new_tokens
        if num_computed_tokens < 0 or num_new_tokens < 0 or len(token_ids) < num_tokens:
            raise ValueError(
                f"{num_computed_tokens=} and {num_new_tokens=} must be >= 0 with a sum "
                f"<= len(token_ids)={len(token_ids)}"
            )
        seq = self._seqs.get(seq_id)
        # The common decode step: one token into the seq's own last block (no new block, no
        # copy); what follows would come to the same with ~4x the host time.
        if num_new_tokens == 1 and seq is not None and not cached_blocks:
            table = seq.table
            index = num_computed_tokens // bs
            if index < len(table) and table[index].ref_cnt == 1 and seq.cpu_table is None:
                # Prefix caching: a block to register once in block_size calls (the check
                # inline: this runs for every decoding sequence every step).
                if self.enable_prefix_caching and _cacheable(
                        num_tokens, num_cacheable_tokens) // bs > len(seq.block_hashes):
                    self._cache_full_blocks(seq_id, seq, token_ids, num_tokens,
                                            num_cacheable_tokens)
                return []
        if seq is not None and seq.cpu_table is not None:
            raise ValueError(f"seq {seq_id} is swapped out; swap_in before allocate_slots")
        table = seq.table if seq is not None else []
        hashes = seq.block_hashes if seq is not None else []
        if not all(0 < i < self.num_gpu_blocks for i in cached_blocks):
            raise ValueError(f"{list(cached_blocks)=} must be GPU block ids in [1, num_gpu_blocks)")
        hit_blocks = [self.gpu_pool.blocks[i] for i in cached_blocks]
        if hit_blocks:
            if table:
                raise ValueError(f"cached_blocks given for seq {seq_id}, which has a block table")
            if num_computed_tokens < len(hit_blocks) * bs:
                raise ValueError(
                    f"{num_computed_tokens=} must be >= {len(hit_blocks)} cached blocks * {bs}"
                )
            # A hit is only valid in the pass that looked it up: an allocation in between may
            # have evicted it. Recomputing the chain also gives this seq its block_hashes.
            hashes = []
            self._extend_hash_chain(hashes, token_ids, len(hit_blocks))
            for block, block_hash in zip(hit_blocks, hashes, strict=True):
                if block.block_hash != block_hash:
                    raise ValueError(f"cached block {block.block_id} no longer holds that prefix")

        num_required = -(-num_tokens // bs)
        num_new_blocks = max(0, num_required - len(table) - len(hit_blocks))
        # Existing blocks that receive new tokens; shared ones must be copied before writing.
        first_written = num_computed_tokens // bs
        written = range(first_written, min(len(table), num_required)) if num_new_tokens else ()
        cow_slots = [i for i in written if table[i].ref_cnt > 1]
        # Hit blocks sitting in the free queue are counted in num_free_blocks but are not
        # available for the new blocks: touching them takes them out of the queue.
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_new_blocks + len(cow_slots) > self.gpu_pool.num_free_blocks - num_evictable_hits:
            return None

        # Past this point nothing can fail: mutate.
        self.gpu_pool.touch(hit_blocks)
        table.extend(hit_blocks)
        copies = []
        for i, dst in zip(cow_slots, self.gpu_pool.get_new_blocks(len(cow_slots)), strict=True):
            src = table[i]
            src.ref_cnt -= 1  # was > 1, so the other owners keep it alive: never freed here
            table[i] = dst
            copies.append((src.block_id, dst.block_id))
        changed = min(cow_slots[0] if cow_slots else len(table), len(table) - len(hit_blocks))
        table.extend(self.gpu_pool.get_new_blocks(num_new_blocks))
        if changed < len(table):
            self.tables.write(seq_id, changed, [b.block_id for b in table[changed:]])
        if seq is None:
            seq = self._seqs[seq_id] = _SeqBlocks(table, hashes)
            self.tables.row(seq_id)  # a row even while the table is empty
        seq.block_hashes = hashes  # a new list only when cached_blocks were attached
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq_id, seq, token_ids, num_tokens, num_cacheable_tokens)
        return copies

    def _cache_full_blocks(self, seq_id: int, seq: _SeqBlocks, token_ids: Sequence[int],
                           num_tokens: int, num_cacheable_tokens: int | None) -> None:
        """Registers the seq's blocks that are full once ``num_tokens`` are written (capped
        at ``num_cacheable_tokens``) in the prefix cache."""
        num_full = _cacheable(num_tokens, num_cacheable_tokens) // self.block_size
        hashes = seq.block_hashes
        start = len(hashes)
        if num_full > start:
            self._extend_hash_chain(hashes, token_ids, num_full)
            for i in range(start, num_full):
                self.gpu_pool.cache_block(seq.table[i], hashes[i])  # keeps an existing entry
        self.register_at[seq_id] = (len(hashes) + 1) * self.block_size

    def _extend_hash_chain(
        self, hashes: list[BlockHash], token_ids: Sequence[int], num_full_blocks: int
    ) -> None:
        bs = self.block_size
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block_tokens(self.hash_algo, parent, token_ids[i * bs : (i + 1) * bs])
            )

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (ref_cnt += 1 each): parallel sampling."""
        parent = self._gpu_seq(parent_seq_id)
        if child_seq_id in self._seqs:
            raise ValueError(f"fork target seq {child_seq_id} already has blocks")
        for block in parent.table:
            block.ref_cnt += 1  # already > 0, so no block leaves the free queue
        self._seqs[child_seq_id] = _SeqBlocks(list(parent.table), list(parent.block_hashes))
        self.tables.copy(parent_seq_id, child_seq_id)

    def free(self, seq_id: int) -> None:
        """Drop the seq's references (GPU or CPU). An unknown seq is a no-op.

        Blocks reaching ref_cnt 0 join the free-queue tail in reverse table order, so the seq's
        tail blocks are evicted first; cached blocks keep their hash until evicted.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self.tables.remove(seq_id)
        self.register_at.pop(seq_id, None)
        if seq.cpu_table is not None:
            self.cpu_pool.free_blocks(reversed(seq.cpu_table))
        self.gpu_pool.free_blocks(reversed(seq.table))

    def reset_prefix_cache(self) -> bool:
        """Evict every cached block no seq references; True iff the prefix cache is now empty.

        Unlike vLLM (which refuses, returning False, while any block is in use), this always
        drops what it can; cached blocks still in use keep their hash and the result is False.
        """
        return self.gpu_pool.reset_prefix_cache()

    def _gpu_seq(self, seq_id: int) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None or seq.cpu_table is not None:
            raise ValueError(f"seq {seq_id} has no GPU block table")
        return seq

    # ---- checks ----------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError on any inconsistency between the tables and the two pools."""
        gpu_owners: collections.Counter[int] = collections.Counter()
        cpu_owners: collections.Counter[int] = collections.Counter()
        for seq_id, seq in self._seqs.items():
            table = seq.table if seq.cpu_table is None else seq.cpu_table
            assert seq.cpu_table is None or not seq.table, f"seq {seq_id} on GPU and CPU"
            assert len({id(b) for b in table}) == len(table), f"seq {seq_id} repeats a block"
            assert len(seq.block_hashes) <= len(table), f"seq {seq_id} hashes unwritten blocks"
            for i, block in enumerate(seq.table):
                assert block is self.gpu_pool.blocks[block.block_id], f"seq {seq_id}: foreign block"
                # A cached block's content is its hash chain: it must be this seq's prefix.
                assert block.block_hash is None or (
                    i < len(seq.block_hashes) and seq.block_hashes[i] == block.block_hash
                ), f"seq {seq_id} slot {i}: block {block.block_id} is cached for another prefix"
            gpu_owners.update(b.block_id for b in seq.table)
            assert self.tables.table(seq_id) == [b.block_id for b in seq.table], (
                f"seq {seq_id}: numpy block table out of date")
            for block in seq.cpu_table or ():
                assert block is self.cpu_pool.blocks[block.block_id], f"seq {seq_id}: bad CPU block"
                cpu_owners[block.block_id] += 1
        self.gpu_pool.check_invariants(gpu_owners, "gpu")
        self.cpu_pool.check_invariants(cpu_owners, "cpu")
        assert not self.cpu_pool.cached_block_hash_to_block, "cpu: CPU blocks are never cached"
        assert self.prefix_cache_hits <= self.prefix_cache_queries
        assert set(self.tables.rows) == set(self._seqs), "numpy block-table rows out of date"
        for seq_id, at in self.register_at.items():
            assert at == (len(self._seqs[seq_id].block_hashes) + 1) * self.block_size, (
                f"seq {seq_id}: register_at out of date")
