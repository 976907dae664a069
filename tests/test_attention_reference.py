"""The paged-attention reference against dense causal attention on unpaged K/V."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.pallas_kernels.paged_attention import paged_attention_reference

BLOCK = 16


def dense_attention(q, k, v, scale, window=None):
    """q [n, Hq, D], k/v [ctx, Hkv, D]: the last n query positions of a length-ctx sequence."""
    n, hq, _ = q.shape
    ctx, hkv, _ = k.shape
    k = np.repeat(k, hq // hkv, axis=1)
    v = np.repeat(v, hq // hkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    qpos = np.arange(ctx - n, ctx)[:, None]
    kpos = np.arange(ctx)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    scores = np.where(mask[None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_ragged_batch_matches_dense(heads, window):
    hq, hkv = heads
    d, num_blocks = 32, 40
    rng = np.random.default_rng(0)
    # (cached tokens, new query tokens) per sequence: decode, prefill, chunk over a cache.
    shapes = [(0, 1), (16, 1), (0, 17), (15, 3), (33, 1)]
    k_pool = rng.standard_normal((1, num_blocks, BLOCK, hkv, d)).astype(np.float32)
    v_pool = rng.standard_normal((1, num_blocks, BLOCK, hkv, d)).astype(np.float32)
    k_pool[:, 0] = v_pool[:, 0] = np.nan  # the null block and unused pages are poisoned
    free = list(rng.permutation(np.arange(1, num_blocks)))
    width = 4
    tables = np.zeros((len(shapes), width), np.int32)
    seq_lens, starts, positions, queries = [], [0], [], []
    used = set()
    for s, (cached, new) in enumerate(shapes):
        total = cached + new
        for b in range(-(-total // BLOCK)):
            tables[s, b] = free.pop()
            used.add(int(tables[s, b]))
        seq_lens.append(total)
        starts.append(starts[-1] + new)
        positions.extend(range(cached, total))
        queries.append(rng.standard_normal((new, hq, d)).astype(np.float32))
    # NaN in every slot past a sequence's length (page tails) must not leak either.
    for s, total in enumerate(seq_lens):
        for pos in range(total, width * BLOCK):
            blk = tables[s, pos // BLOCK]
            if blk:
                k_pool[0, blk, pos % BLOCK] = v_pool[0, blk, pos % BLOCK] = np.nan
    for blk in set(range(1, num_blocks)) - used:
        k_pool[0, blk] = v_pool[0, blk] = np.nan
    q = np.concatenate(queries)
    scale = d ** -0.5
    out = paged_attention_reference(
        jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), 0, jnp.asarray(tables),
        jnp.asarray(seq_lens, jnp.int32), jnp.asarray(starts, jnp.int32),
        jnp.asarray(positions, jnp.int32), scale=scale, sliding_window=window)
    out = np.asarray(out)
    assert not np.isnan(out).any()
    for s, (cached, new) in enumerate(shapes):
        total = cached + new
        slots = [(tables[s, p // BLOCK], p % BLOCK) for p in range(total)]
        k = np.stack([k_pool[0, b, o] for b, o in slots])
        v = np.stack([v_pool[0, b, o] for b, o in slots])
        expected = dense_attention(queries[s], k, v, scale, window)
        np.testing.assert_allclose(out[starts[s]:starts[s + 1]], expected, atol=1e-5, rtol=1e-5)


def test_long_prefill_is_chunked_without_changing_results():
    rng = np.random.default_rng(1)
    hq = hkv = 2
    d, n = 16, 300  # > the reference's query chunk
    blocks = -(-n // BLOCK)
    k_pool = rng.standard_normal((2, blocks + 1, BLOCK, hkv, d)).astype(np.float32)
    v_pool = rng.standard_normal((2, blocks + 1, BLOCK, hkv, d)).astype(np.float32)
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    out = paged_attention_reference(
        jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.int32(1),
        jnp.arange(1, blocks + 1, dtype=jnp.int32)[None], jnp.array([n], jnp.int32),
        jnp.array([0, n], jnp.int32), jnp.arange(n, dtype=jnp.int32), scale=0.25)
    k = k_pool[1, 1:].reshape(-1, hkv, d)[:n]
    v = v_pool[1, 1:].reshape(-1, hkv, d)[:n]
    np.testing.assert_allclose(np.asarray(out), dense_attention(q, k, v, 0.25), atol=1e-5)
