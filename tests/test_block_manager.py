"""BlockManager: exact block ids by hand, then a long random run against a shadow model.

Block ids in the hand-computed tests follow from two rules: get_new_blocks pops the free-queue
head (a fresh manager's queue is 1, 2, ..., num_gpu_blocks - 1) and free appends a seq's blocks
at the tail in reverse table order.
"""

from __future__ import annotations

import hashlib
import pathlib
import random
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


# ---- random operations against a shadow model ------------------------------------------------


class ShadowKV:
    """What the device would hold: block id -> tokens written in its slots (None = never)."""

    def __init__(self, bm: BlockManager):
        self.bs = bm.block_size
        self.gpu = {i: [None] * self.bs for i in range(bm.num_gpu_blocks)}
        self.cpu = {i: [None] * self.bs for i in range(bm.num_cpu_blocks)}

    def write(self, table, tokens, start, stop):
        for p in range(start, stop):
            self.gpu[table[p // self.bs]][p % self.bs] = tokens[p]

    def holds(self, table, tokens, num_computed) -> bool:
        """Do the seq's blocks hold its first ``num_computed`` tokens?"""
        for j in range(-(-num_computed // self.bs)):
            expected = tokens[j * self.bs : min((j + 1) * self.bs, num_computed)]
            if self.gpu[table[j]][: len(expected)] != expected:
                return False
        return True


@pytest.mark.parametrize(
    "num_ops, caching, algo",
    # 40k operations reach every operation thousands of times (100k took 37 s of make test).
    [(40_000, True, "builtin"), (10_000, True, "sha256"), (10_000, False, "builtin")],
)
def test_random_operations_keep_every_sequence_reading_its_own_tokens(num_ops, caching, algo):
    rng = random.Random(20240601)
    bs, alphabet = 4, 3  # a tiny alphabet so unrelated prompts share blocks too
    bm = BlockManager(
        64, bs, num_cpu_blocks=32, enable_prefix_caching=caching, prefix_caching_hash_algo=algo
    )
    kv = ShadowKV(bm)
    documents = [[rng.randrange(alphabet) for _ in range(rng.randint(8, 24))] for _ in range(6)]
    tokens: dict[int, list[int]] = {}  # live seq -> token ids (prompt + outputs)
    computed: dict[int, int] = {}  # live seq -> num_computed_tokens
    family: dict[int, int] = {}  # live seq -> id of the seq it was forked from, transitively
    next_id = 0
    stats = dict(hits=0, hits_on_freed=0, evictions=0, cows=0, swaps=0, nones=0)

    def allocate(seq_id, num_new, cached=()):
        """allocate_slots, then apply the copies and write the new tokens as the device would."""
        toks, start = tokens[seq_id], computed[seq_id]
        evictable = {b.block_id for b in bm.gpu_pool.cached_block_hash_to_block.values()}
        evictable -= {b for b in range(64) if bm.gpu_pool.blocks[b].ref_cnt} | set(cached)
        before = snapshot(bm, tokens) if rng.random() < 0.2 else None
        old_table = bm.block_table(seq_id)
        copies = bm.allocate_slots(seq_id, toks, start, num_new, cached)
        if copies is None:
            stats["nones"] += 1
            assert before is None or snapshot(bm, tokens) == before
            return False
        for src, dst in copies:
            kv.gpu[dst] = list(kv.gpu[src])
        stats["cows"] += len(copies)
        table = bm.block_table(seq_id)
        stats["evictions"] += len(evictable & (set(table) - set(old_table)))
        kv.write(table, toks, start, start + num_new)
        computed[seq_id] = start + num_new
        return True

    for _ in range(num_ops):
        gpu_seqs = [s for s in tokens if not bm.is_swapped(s)]
        swapped = [s for s in tokens if bm.is_swapped(s)]
        crowded = bm.num_free_blocks < 8 or len(tokens) > 12
        op = rng.choices(
            ["new", "step", "fork", "free", "swap_out", "swap_in", "reset"],
            weights=[25, 40, 6, 30 if crowded else 8, 5, 6, 0.3],
        )[0]
        if op == "new":
            doc = rng.choice(documents)
            prompt = doc[: rng.randint(1, len(doc))]
            prompt += [rng.randrange(alphabet) for _ in range(rng.randint(0, 6))]
            cached, num_cached = bm.lookup_prefix(prompt)
            assert num_cached == len(cached) * bs < len(prompt)
            stats["hits"] += len(cached)
            stats["hits_on_freed"] += sum(bm.gpu_pool.blocks[b].ref_cnt == 0 for b in cached)
            seq_id, next_id = next_id, next_id + 1
            tokens[seq_id], computed[seq_id], family[seq_id] = prompt, num_cached, seq_id
            num_new = min(len(prompt) - num_cached, rng.randint(1, 16))  # maybe a chunk
            if not allocate(seq_id, num_new, cached):
                del tokens[seq_id], computed[seq_id], family[seq_id]
        elif op == "step" and gpu_seqs:
            seq_id = rng.choice(gpu_seqs)
            toks = tokens[seq_id]
            if computed[seq_id] == len(toks):  # decode: sample 1..3 tokens, then compute them
                toks += [rng.randrange(alphabet) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
            allocate(seq_id, min(len(toks) - computed[seq_id], rng.randint(1, 8)))
        elif op == "fork" and gpu_seqs:
            parent = rng.choice(gpu_seqs)
            child, next_id = next_id, next_id + 1
            bm.fork(parent, child)
            tokens[child], computed[child] = list(tokens[parent]), computed[parent]
            family[child] = family[parent]
        elif op == "free" and tokens:
            seq_id = rng.choice(list(tokens))
            bm.free(seq_id)
            del tokens[seq_id], computed[seq_id], family[seq_id]
        elif op in ("swap_out", "swap_in") and (gpu_seqs if op == "swap_out" else swapped):
            pool = gpu_seqs if op == "swap_out" else swapped
            if rng.random() < 0.5:  # a whole forked group, or any few seqs
                group = family[rng.choice(pool)]
                seq_ids = [s for s in pool if family[s] == group]
            else:
                seq_ids = rng.sample(pool, min(len(pool), rng.randint(1, 3)))
            can = bm.can_swap_out(seq_ids) if op == "swap_out" else bm.can_swap_in(seq_ids)
            if not can:
                before = snapshot(bm, tokens)
                with pytest.raises(ValueError):
                    getattr(bm, op)(seq_ids)
                assert snapshot(bm, tokens) == before
            elif op == "swap_out":
                for gpu_block, cpu_block in bm.swap_out(seq_ids):
                    kv.cpu[cpu_block] = list(kv.gpu[gpu_block])
                stats["swaps"] += 1
            else:
                for cpu_block, gpu_block in bm.swap_in(seq_ids):
                    kv.gpu[gpu_block] = list(kv.cpu[cpu_block])
        elif op == "reset":
            assert bm.reset_prefix_cache() == (not bm.gpu_pool.cached_block_hash_to_block)

        bm.check_invariants()
        for seq_id, toks in tokens.items():
            if not bm.is_swapped(seq_id):
                table = bm.block_table(seq_id)
                assert len(table) * bs >= computed[seq_id]
                assert kv.holds(table, toks, computed[seq_id]), (seq_id, table, toks)

    assert stats["cows"] > 100 and stats["swaps"] > 100 and stats["nones"] > 10, stats
    if caching:
        assert stats["hits"] > num_ops // 10 and stats["hits_on_freed"] > 100, stats
        assert stats["evictions"] > 100, stats
        assert bm.prefix_cache_hits == stats["hits"] * bs
    for seq_id in list(tokens):
        bm.free(seq_id)
    bm.check_invariants()
    assert (bm.num_free_blocks, bm.num_free_cpu_blocks, bm.usage) == (63, 32, 0.0)
