"""BlockManager: exact block ids by hand (the random run: test_block_manager_random.py).

Block ids in the hand-computed tests follow from two rules: get_new_blocks pops the free-queue
head (a fresh manager's queue is 1, 2, ..., num_gpu_blocks - 1) and free appends a seq's blocks
at the tail in reverse table order.
"""

from __future__ import annotations

import hashlib
import pathlib
import struct
import subprocess
import sys
import textwrap

import pytest

from jaxllm.engine.block_manager import BlockManager

ROOT = pathlib.Path(__file__).resolve().parent.parent


def snapshot(bm: BlockManager, seq_ids=range(100)):
    """Everything observable about the manager, to assert that a failed call changed nothing."""
    pools = []
    for pool in (bm.gpu_pool, bm.cpu_pool):
        pools.append(
            (
                tuple((b.ref_cnt, b.block_hash) for b in pool.blocks),
                tuple(pool.free_block_queue),
                tuple(pool.cached_block_hash_to_block.items()),
            )
        )
    tables = {s: (bm.block_table(s), bm.is_swapped(s)) for s in seq_ids if bm.has_seq(s)}
    return pools, tables, bm.prefix_cache_queries, bm.prefix_cache_hits


def free_queue(bm: BlockManager) -> list[int]:
    return list(bm.gpu_pool.free_block_queue)


# ---- allocation and free order ---------------------------------------------------------------


def test_fresh_manager_hands_out_blocks_from_one_upwards():
    bm = BlockManager(8, 4)
    assert (bm.num_free_blocks, bm.usage) == (7, 0.0)
    assert bm.allocate_slots(1, range(10), 0, 10) == []
    assert bm.block_table(1) == [1, 2, 3]
    assert bm.allocate_slots(2, range(4), 0, 4) == []
    assert bm.block_table(2) == [4]
    # Token 10 fits in block 3 (which holds tokens 8, 9); tokens 11, 12 need one more block.
    assert bm.allocate_slots(1, range(11), 10, 1) == []
    assert bm.block_table(1) == [1, 2, 3]
    assert bm.allocate_slots(1, range(13), 11, 2) == []
    assert bm.block_table(1) == [1, 2, 3, 5] and bm.num_blocks(1) == 4
    assert (bm.num_free_blocks, bm.usage) == (2, 5 / 7)
    assert bm.block_table(99) == [] and bm.num_blocks(99) == 0 and not bm.has_seq(99)
    bm.check_invariants()


def test_free_appends_reverse_table_order_so_tail_blocks_are_evicted_first():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    prompt = list(range(100, 112))  # 3 full blocks, all cached
    assert bm.allocate_slots(1, prompt, 0, 12) == []
    assert bm.block_table(1) == [1, 2, 3]
    bm.free(1)
    assert free_queue(bm) == [4, 5, 6, 7, 3, 2, 1]
    assert bm.lookup_prefix(prompt + [0]) == ([1, 2, 3], 12)
    # 5 new blocks: 4..7, then block 3 (prompt's tail), whose hash is evicted.
    assert bm.allocate_slots(2, range(20), 0, 20) == []
    assert bm.block_table(2) == [4, 5, 6, 7, 3]
    assert bm.lookup_prefix(prompt + [0]) == ([1, 2], 8)
    assert bm.lookup_prefix(list(range(20))) == ([4, 5, 6, 7], 16)  # capped: one token left
    bm.check_invariants()


def test_free_of_unknown_seq_is_a_no_op():
    bm = BlockManager(8, 4)
    bm.allocate_slots(1, range(5), 0, 5)
    before = snapshot(bm)
    bm.free(42)
    assert snapshot(bm) == before


def test_null_block_is_never_handed_out_even_when_the_pool_is_exhausted():
    bm = BlockManager(4, 4, num_cpu_blocks=4, enable_prefix_caching=True)
    assert bm.allocate_slots(1, range(12), 0, 12) == []
    assert bm.block_table(1) == [1, 2, 3]
    assert (bm.num_free_blocks, bm.usage) == (0, 1.0)
    assert bm.allocate_slots(2, range(1), 0, 1) is None
    bm.swap_out([1])
    bm.swap_in([1])
    assert bm.block_table(1) == [3, 2, 1]  # freed in reverse order, reused from the head
    bm.free(1)
    assert bm.allocate_slots(3, range(12), 0, 12) == []
    assert sorted(bm.block_table(3)) == [1, 2, 3]
    bm.check_invariants()


def test_failed_allocation_changes_nothing():
    bm = BlockManager(4, 4)
    assert bm.allocate_slots(1, range(8), 0, 8) == []
    before = snapshot(bm)
    assert bm.allocate_slots(2, range(12), 0, 12) is None  # needs 3, 1 free
    assert bm.allocate_slots(1, range(20), 8, 12) is None  # needs 3 more, 1 free
    assert snapshot(bm) == before and not bm.has_seq(2)
    bm.check_invariants()


def test_prefix_hit_blocks_in_the_free_queue_do_not_count_as_free_for_the_rest():
    bm = BlockManager(5, 4, enable_prefix_caching=True)
    prompt = [7] * 8
    bm.allocate_slots(1, prompt, 0, 8)
    bm.free(1)
    assert free_queue(bm) == [3, 4, 2, 1] and bm.num_free_blocks == 4
    tokens = prompt + [5] * 9  # 17 tokens = 5 blocks: 2 hits + 3 new, but only 2 others free
    assert bm.lookup_prefix(tokens) == ([1, 2], 8)
    before = snapshot(bm)
    assert bm.allocate_slots(2, tokens, 8, 9, cached_blocks=[1, 2]) is None
    assert snapshot(bm) == before
    assert bm.allocate_slots(2, tokens[:16], 8, 8, cached_blocks=[1, 2]) == []
    assert bm.block_table(2) == [1, 2, 3, 4] and bm.num_free_blocks == 0
    bm.check_invariants()


# ---- prefix caching ----------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_prefix_hit_returns_the_exact_blocks_and_touches_them(algo):
    bm = BlockManager(16, 4, enable_prefix_caching=True, prefix_caching_hash_algo=algo)
    prompt = list(range(10))  # blocks 1, 2 full (cached), block 3 holds 2 tokens
    assert bm.lookup_prefix(prompt) == ([], 0)
    assert bm.allocate_slots(1, prompt, 0, 10) == []
    other = prompt[:8] + [50, 51, 52]
    assert bm.lookup_prefix(other) == ([1, 2], 8)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (21, 8)
    assert bm.allocate_slots(2, other, 8, 3, cached_blocks=[1, 2]) == []
    assert bm.block_table(2) == [1, 2, 4]
    assert [bm.gpu_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    bm.free(1)
    bm.free(2)
    assert free_queue(bm)[-4:] == [3, 4, 2, 1]
    # Hits on freed (ref_cnt 0) blocks take them out of the middle of the free queue.
    assert bm.lookup_prefix(prompt) == ([1, 2], 8)
    assert bm.allocate_slots(3, prompt, 8, 2, cached_blocks=[1, 2]) == []
    assert bm.block_table(3) == [1, 2, 5]
    assert 1 not in free_queue(bm) and 2 not in free_queue(bm)
    bm.check_invariants()


def test_sha256_hash_is_a_chain_over_little_endian_int64_tokens():
    bm = BlockManager(8, 4, enable_prefix_caching=True, prefix_caching_hash_algo="sha256")
    bm.allocate_slots(1, range(8), 0, 8)
    h0 = hashlib.sha256(struct.pack("<4q", 0, 1, 2, 3)).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<4q", 4, 5, 6, 7)).digest()
    assert bm.gpu_pool.blocks[1].block_hash.value == h0
    assert bm.gpu_pool.blocks[2].block_hash.value == h1


def test_lookup_leaves_at_least_one_token_to_compute():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    bm.allocate_slots(1, prompt, 0, 8)
    assert bm.lookup_prefix(prompt) == ([1], 4)  # (8 - 1) // 4 = 1 block
    assert bm.lookup_prefix(prompt + [5]) == ([1, 2], 8)
    assert bm.lookup_prefix(prompt[:4]) == ([], 0)
    assert bm.lookup_prefix([]) == ([], 0)
    assert bm.lookup_prefix([9] + prompt) == ([], 0)


def test_prefix_caching_off_never_hits_or_counts():
    bm = BlockManager(8, 4)
    bm.allocate_slots(1, range(8), 0, 8)
    assert bm.lookup_prefix(list(range(9))) == ([], 0)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
    assert not bm.gpu_pool.cached_block_hash_to_block


def test_duplicate_content_keeps_the_first_cached_block():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    bm.allocate_slots(1, [1, 2, 3, 4], 0, 4)
    bm.allocate_slots(2, [1, 2, 3, 4], 0, 4)  # computed again without a lookup
    assert bm.block_table(2) == [2]
    assert bm.gpu_pool.blocks[2].block_hash is None
    assert bm.lookup_prefix([1, 2, 3, 4, 5]) == ([1], 4)
    bm.check_invariants()


def test_stale_prefix_hit_is_rejected():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    bm.allocate_slots(1, range(8), 0, 8)
    bm.free(1)
    hit, num_cached = bm.lookup_prefix(list(range(9)))
    assert hit == [1, 2]
    bm.allocate_slots(2, [9] * 12, 0, 12)  # takes 3, 2, 1: evicts both hashes
    bm.free(2)
    with pytest.raises(ValueError, match="no longer holds"):
        bm.allocate_slots(3, list(range(9)), num_cached, 1, cached_blocks=hit)
    bm.check_invariants()


def test_reset_prefix_cache_drops_unreferenced_hashes_only():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    bm.allocate_slots(1, [1] * 8, 0, 8)
    bm.allocate_slots(2, [2] * 8, 0, 8)
    bm.free(2)
    assert bm.reset_prefix_cache() is False  # seq 1's cached blocks are in use
    assert bm.lookup_prefix([2] * 9) == ([], 0)
    assert bm.lookup_prefix([1] * 9) == ([1, 2], 8)
    bm.free(1)
    assert bm.reset_prefix_cache() is True
    assert bm.lookup_prefix([1] * 9) == ([], 0)
    bm.check_invariants()


# ---- fork and copy-on-write --------------------------------------------------------------------


def test_fork_then_append_copies_the_shared_partial_block():
    bm = BlockManager(8, 4)
    tokens = list(range(6))
    bm.allocate_slots(1, tokens, 0, 6)
    bm.fork(1, 2)
    assert bm.block_table(2) == [1, 2] and bm.usage == 2 / 7
    assert bm.allocate_slots(2, tokens + [60], 6, 1) == [(2, 3)]
    assert (bm.block_table(1), bm.block_table(2)) == ([1, 2], [1, 3])
    assert bm.allocate_slots(1, tokens + [61], 6, 1) == []  # block 2 is seq 1's alone now
    bm.free(1)
    assert free_queue(bm) == [4, 5, 6, 7, 2]
    bm.free(2)
    assert free_queue(bm) == [4, 5, 6, 7, 2, 3, 1]
    bm.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(8, 4)
    bm.allocate_slots(1, range(8), 0, 8)
    bm.fork(1, 2)
    assert bm.allocate_slots(2, list(range(9)), 8, 1) == []
    assert bm.block_table(2) == [1, 2, 3]


def test_copy_on_write_spanning_into_new_blocks_and_running_out():
    bm = BlockManager(5, 4)
    tokens = list(range(6))
    bm.allocate_slots(1, tokens, 0, 6)
    bm.fork(1, 2)
    assert bm.allocate_slots(2, tokens + [1, 2, 3, 4], 6, 4) == [(2, 3)]  # then new block 4
    assert bm.block_table(2) == [1, 3, 4]
    bm.fork(1, 3)
    before = snapshot(bm)
    assert bm.allocate_slots(3, tokens + [9], 6, 1) is None  # the copy needs a free block
    assert snapshot(bm) == before
    bm.check_invariants()


# ---- swap ----------------------------------------------------------------------------------------


def test_swap_round_trip_copies_shared_blocks_once():
    bm = BlockManager(8, 4, num_cpu_blocks=4)
    tokens = list(range(10))
    bm.allocate_slots(1, tokens, 0, 10)
    bm.fork(1, 2)
    assert bm.can_swap_out([1, 2])
    assert bm.swap_out([1, 2]) == [(1, 0), (2, 1), (3, 2)]  # 3 CPU blocks, not 6
    assert (bm.num_free_cpu_blocks, bm.cpu_usage, bm.num_free_blocks) == (1, 0.75, 7)
    assert bm.is_swapped(1) and bm.is_swapped(2) and bm.has_seq(1)
    assert bm.block_table(1) == []
    assert [b.ref_cnt for b in bm.cpu_pool.blocks] == [2, 2, 2, 0]
    bm.check_invariants()
    assert bm.can_swap_in([1, 2])
    assert bm.swap_in([1, 2]) == [(0, 4), (1, 5), (2, 6)]
    assert bm.block_table(1) == bm.block_table(2) == [4, 5, 6]
    assert bm.num_free_cpu_blocks == 4 and not bm.is_swapped(1)
    assert bm.allocate_slots(2, tokens + [99], 10, 1) == [(6, 7)]  # sharing survived: COW
    bm.check_invariants()


def test_swap_without_space_raises_and_changes_nothing():
    bm = BlockManager(8, 4, num_cpu_blocks=2)
    bm.allocate_slots(1, range(12), 0, 12)
    before = snapshot(bm)
    assert not bm.can_swap_out([1])
    with pytest.raises(ValueError, match="swap space"):
        bm.swap_out([1])
    assert snapshot(bm) == before
    bm.free(1)
    bm.allocate_slots(2, range(8), 0, 8)
    bm.swap_out([2])
    bm.allocate_slots(3, range(24), 0, 24)  # 6 of the 7 GPU blocks
    before = snapshot(bm)
    assert not bm.can_swap_in([2])
    with pytest.raises(ValueError):
        bm.swap_in([2])
    assert snapshot(bm) == before
    bm.free(2)  # frees its CPU blocks
    assert bm.num_free_cpu_blocks == 2 and not bm.has_seq(2)
    bm.check_invariants()


def test_misuse_raises():
    bm = BlockManager(8, 4, num_cpu_blocks=4)
    bm.allocate_slots(1, range(4), 0, 4)
    with pytest.raises(ValueError):
        bm.fork(1, 1)
    with pytest.raises(ValueError):
        bm.fork(7, 8)
    with pytest.raises(ValueError):
        bm.allocate_slots(1, range(4), 4, 1)  # token_ids too short
    bm.swap_out([1])
    with pytest.raises(ValueError, match="swapped"):
        bm.allocate_slots(1, range(5), 4, 1)
    with pytest.raises(ValueError):
        bm.swap_out([1])
    with pytest.raises(ValueError):
        BlockManager(1, 4)
    with pytest.raises(ValueError):
        BlockManager(8, 4, prefix_caching_hash_algo="md5")


# ---- layering ------------------------------------------------------------------------------------


def test_block_manager_and_scheduler_import_without_jax():
    # jaxllm/__init__.py imports the model (and so jax): stub the packages to load only this one.
    script = textwrap.dedent(
        f"""
        import sys, types

        class BlockJax:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib"):
                    raise ImportError(name + " is blocked")

        sys.meta_path.insert(0, BlockJax())
        for name, path in (("jaxllm", "jaxllm"), ("jaxllm.engine", "jaxllm/engine")):
            package = types.ModuleType(name)
            package.__path__ = [{str(ROOT)!r} + "/" + path]
            sys.modules[name] = package
        from jaxllm.engine.block_manager import BlockManager
        bm = BlockManager(8, 4, num_cpu_blocks=2, enable_prefix_caching=True)
        assert bm.allocate_slots(1, range(9), 0, 9) == []
        # The rest of the host-side engine is plain Python too.
        from jaxllm.engine.engine_config import SchedulerConfig
        from jaxllm.engine.detokenizer import IncrementalDetokenizer
        from jaxllm.engine.scheduler import Scheduler
        from jaxllm.engine.sequence import SequenceGroup
        Scheduler(SchedulerConfig(4, 16, 16), BlockManager(8, 4))
        assert not [m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib")]
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT)
