"""BlockManager under a long random run of every operation against a shadow model of the
device's KV blocks: every live sequence must keep reading its own tokens."""

from __future__ import annotations

import random

import pytest
from test_block_manager import snapshot

from jaxllm.engine.block_manager import BlockManager


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
