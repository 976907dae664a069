"""The physical side of the paged KV cache: ref-counted blocks, free queue, prefix-cache map.

Plain Python, no ``jax``: the scheduler runs on the host and only hands block ids to the device.
One :class:`BlockPool` manages the GPU blocks and another the CPU (swap) blocks.

    block_id     0      1      2      3      4      5      6      7
               +------+------+------+------+------+------+------+------+
    GPU pool   | null | s1:0 | s1:1 | s1:2 | free | s2:0 | free | free |
               +------+------+------+------+------+------+------+------+
    ref_cnt       -      2      2      1      0      1      0      0
    block_hash    -      h0     h1     -      h7     -      -      -

    (s1 was forked into s3, so s1 and s3 share blocks 1 and 2: ref_cnt 2.)

    free queue: every block with ref_cnt == 0, cached (hashed) or not, least recently freed first.
        head -> [6] -> [7] -> [4 h7] -> tail
         ^ get_new_blocks() pops here; taking a hashed block evicts its hash (LRU)
                                         ^ free_blocks() appends here
    touch(): a prefix-cache hit on a ref_cnt == 0 block takes it out of the middle of the queue.

The null block (id 0, GPU only) is never handed out, freed or cached: padded block-table entries
point at it. A block is registered in ``cached_block_hash_to_block`` only once it is full, and it
keeps its hash after being freed, until it is evicted or the cache is reset.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import NamedTuple

HASH_ALGOS = ("builtin", "sha256")


class BlockHash(NamedTuple):
    """Key of a full block in the prefix cache.

    ``value`` chains the parent block's value with this block's tokens, so equal values mean equal
    prefixes. The tokens stay in the key (as vLLM does) so a collision of the builtin 64-bit hash
    can only matter if the parent chains collide too.
    """

    value: int | bytes
    token_ids: tuple[int, ...]


def hash_block_tokens(algo: str, parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """hash(parent_hash, block tokens); ``parent`` is None for a sequence's first block."""
    tokens = tuple(token_ids)
    if algo == "builtin":
        # Hashes of ints, None (3.12+) and tuples of them do not depend on PYTHONHASHSEED.
        return BlockHash(hash((None if parent is None else parent.value, tokens)), tokens)
    # sha256 over a stable byte encoding: parent digest, then tokens as little-endian int64.
    digest = hashlib.sha256(b"" if parent is None else parent.value)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return BlockHash(digest.digest(), tokens)


@dataclasses.dataclass(slots=True, eq=False)  # eq=False: blocks compare and hash by identity
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0  # number of (sequence, block-table slot) owners
    block_hash: BlockHash | None = None  # set while this block is the prefix cache's copy


class BlockPool:
    """``num_blocks`` ref-counted blocks with an O(1) LRU free queue and a ``block_hash`` map.

    The free queue is an OrderedDict block_id -> block: popping the head, appending at the tail and
    removing from the middle (touch) are all O(1), like vLLM's doubly linked list.
    """

    def __init__(self, num_blocks: int, *, reserve_null_block: bool) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0] if reserve_null_block else None
        first = 1 if reserve_null_block else 0
        self.free_block_queue: collections.OrderedDict[int, KVCacheBlock] = collections.OrderedDict(
            (b.block_id, b) for b in self.blocks[first:]
        )
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks get_new_blocks can hand out now: free ones plus evictable cached ones."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        usable = self.num_usable_blocks
        return (usable - self.num_free_blocks) / usable if usable else 0.0

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` off the free-queue head (evicting hashes), each with ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"{num_blocks=} must be <= num_free_blocks={self.num_free_blocks}")
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_block_queue.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (cached) blocks; a ref_cnt 0 block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue tail in the given order.

        Callers pass a sequence's table reversed, so its tail blocks (the least shareable
        prefixes) are evicted before its head blocks.
        """
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full block under ``block_hash`` unless some block already holds that hash.

        Keeping the first copy means a hash always names exactly one block; the duplicate simply
        stays uncached (same content, different physical block).
        """
        if block_hash in self.cached_block_hash_to_block or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Evict every cached block nobody references; True iff the cache is now empty."""
        for block in list(self.cached_block_hash_to_block.values()):
            if block.ref_cnt == 0:
                self._evict(block)
        return not self.cached_block_hash_to_block

    def check_invariants(self, owners: collections.Counter[int], name: str) -> None:
        """Assert the pool agrees with ``owners`` (block_id -> number of block-table slots)."""
        free_ids = list(self.free_block_queue)
        assert len(set(free_ids)) == len(free_ids), f"{name}: duplicate in free queue"
        for block_id, block in self.free_block_queue.items():
            assert block is self.blocks[block_id], f"{name}: free queue maps {block_id} wrongly"
        if self.null_block is not None:
            null = self.null_block
            assert null.block_id not in self.free_block_queue, f"{name}: null block is free"
            assert null.block_id not in owners, f"{name}: null block is in a block table"
            assert null.ref_cnt == 0 and null.block_hash is None, f"{name}: null block was used"
        assert all(0 <= i < self.num_blocks for i in owners), f"{name}: table holds a bad id"
        num_used = 0
        for block in self.blocks:
            if block is self.null_block:
                continue
            assert block.ref_cnt == owners.get(block.block_id, 0), (
                f"{name}: block {block.block_id} ref_cnt={block.ref_cnt} but "
                f"{owners.get(block.block_id, 0)} owners"
            )
            is_free = block.block_id in self.free_block_queue
            assert is_free == (block.ref_cnt == 0), f"{name}: block {block.block_id} free+used"
            num_used += not is_free
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"{name}: block {block.block_id} has a hash the map does not point back to"
                )
        assert num_used + len(free_ids) == self.num_usable_blocks, f"{name}: free + used != total"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"{name}: map entry for {block.block_id} stale"
            assert block is not self.null_block, f"{name}: null block is cached"
