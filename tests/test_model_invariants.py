"""The serving invariant on tiny random configs: however tokens are split into steps, batched,
padded or placed in the pool, every position's logits are the same."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import TINY_CONFIGS, PagedRunner, random_params

from jaxllm import KVPool, LayeredKVPool, SeqChunk, load_model, pack_batch
from jaxllm.models.llama import make_forward, unstack_layer_params

SEQ_LEN = 23
ATOL = 2e-5


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def model(request):
    cfg = TINY_CONFIGS[request.param]
    return cfg, random_params(cfg, seed=3)


def tokens(cfg, n=SEQ_LEN, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n).tolist()


def table(n_blocks, start=1):
    return list(range(start, start + n_blocks))


def test_full_prefill_equals_chunked_prefill_equals_decode(model):
    cfg, params = model
    ids = tokens(cfg)
    blocks = table(6)
    full = PagedRunner(cfg, params).run(ids, [SEQ_LEN], blocks)
    chunked = PagedRunner(cfg, params).run(ids, [5, 4, 9, 5], blocks)
    decode = PagedRunner(cfg, params).run(ids, [1] * SEQ_LEN, blocks)
    assert np.abs(full).max() > 0.1  # logits carry signal, not near-uniform
    np.testing.assert_allclose(chunked, full, atol=ATOL, rtol=1e-5)
    np.testing.assert_allclose(decode, full, atol=ATOL, rtol=1e-5)
    assert (chunked.argmax(-1) == full.argmax(-1)).all()


def test_shuffled_block_table_gives_identical_logits(model):
    cfg, params = model
    ids = tokens(cfg)
    ordered = PagedRunner(cfg, params).run(ids, [9, 14], table(6))
    shuffled_table = [int(b) for b in np.random.default_rng(1).permutation(np.arange(1, 60))[:6]]
    shuffled = PagedRunner(cfg, params).run(ids, [9, 14], shuffled_table)
    np.testing.assert_array_equal(shuffled, ordered)


def test_padding_never_changes_real_outputs(model):
    cfg, params = model
    ids_a, ids_b = tokens(cfg, 11, seed=1), tokens(cfg, 6, seed=2)
    chunks = [SeqChunk(ids_a, 0, table(3, 1)), SeqChunk(ids_b, 0, table(2, 10))]
    exact = PagedRunner(cfg, params).step(chunks)
    runner = PagedRunner(cfg, params)
    padded = runner.step(chunks, num_tokens=32, num_seqs=5, table_width=8)
    np.testing.assert_allclose(padded, exact, atol=ATOL, rtol=1e-5)
    # Padded tokens wrote nothing (block 0, the null block, stays zeros), and decoding on
    # from the padded pool still matches.
    assert not np.asarray(runner.pool.k[:, 0]).any() and not np.asarray(runner.pool.v[:, 0]).any()
    used = np.zeros(runner.pool.k.shape[1], bool)
    used[table(3, 1) + table(2, 10)] = True
    assert not np.asarray(runner.pool.k[:, ~used]).any()
    exact_next = PagedRunner(cfg, params)
    exact_next.step(chunks)
    nxt = [SeqChunk([5], 11, table(3, 1)), SeqChunk([7], 6, table(2, 10))]
    np.testing.assert_allclose(runner.step(nxt, num_tokens=8, num_seqs=4),
                               exact_next.step(nxt), atol=ATOL, rtol=1e-5)
    assert not np.isnan(np.asarray(runner.pool.k[:, 1:])).any()


def test_mixed_batch_of_prefill_and_decode_matches_each_sequence_alone(model):
    cfg, params = model
    a, b = tokens(cfg, 17, seed=4), tokens(cfg, 9, seed=5)
    alone_a = PagedRunner(cfg, params).run(a, [12, 1, 1, 1, 1, 1], table(5, 1))
    alone_b = PagedRunner(cfg, params).run(b, [9], table(3, 20))
    runner = PagedRunner(cfg, params)
    first = runner.step([SeqChunk(a[:12], 0, table(5, 1))])
    # One step holding a decode of `a` and the whole prefill of `b`.
    mixed = runner.step([SeqChunk(a[12:13], 12, table(5, 1)), SeqChunk(b, 0, table(3, 20))])
    np.testing.assert_allclose(first, alone_a[:12], atol=ATOL, rtol=1e-5)
    np.testing.assert_allclose(mixed[0], alone_a[12], atol=ATOL, rtol=1e-5)
    np.testing.assert_allclose(mixed[1:], alone_b, atol=ATOL, rtol=1e-5)


def test_sliding_window_limits_attention():
    cfg = TINY_CONFIGS["mistral_sliding"]
    params = random_params(cfg, seed=3)
    ids = tokens(cfg)
    windowed = PagedRunner(cfg, params).run(ids, [SEQ_LEN], table(6))
    unwindowed = PagedRunner(cfg.replace(sliding_window=None), params).run(ids, [SEQ_LEN], table(6))
    window = cfg.sliding_window
    np.testing.assert_allclose(windowed[:window], unwindowed[:window], atol=ATOL, rtol=1e-5)
    assert np.abs(windowed[window:] - unwindowed[window:]).max() > 1e-3


def test_unrolled_layout_gives_the_same_logits_and_cache_as_the_scanned_one():
    cfg = TINY_CONFIGS["llama3_rope_scaling"]
    params = random_params(cfg, seed=3)
    ids = tokens(cfg)
    chunks = [5, 1, SEQ_LEN - 6]  # later chunks read what earlier ones cached
    per_layer = unstack_layer_params(params)  # one param tree per layer: the unrolled stack
    assert len(per_layer["layers"]) == cfg.num_hidden_layers
    looped = PagedRunner(cfg, params)
    unrolled = PagedRunner(cfg, per_layer)
    assert isinstance(looped.pool, KVPool) and isinstance(unrolled.pool, LayeredKVPool)
    np.testing.assert_allclose(unrolled.run(ids, chunks, table(6)),
                               looped.run(ids, chunks, table(6)), atol=1e-5)
    blocks = jnp.arange(looped.pool.num_blocks)
    for got, want in zip(unrolled.pool.read_blocks(blocks), looped.pool.read_blocks(blocks),
                         strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    batch = pack_batch([SeqChunk(ids[:3], 0, table(6))], 4)
    loops = lambda runner: runner.forward.lower(runner.params, runner.pool, batch).as_text(
    ).count("stablehlo.while")
    assert loops(unrolled) == loops(looped) - 1  # no layer loop: straight-line layers
    # donate: the caller's stacked leaves are deleted once sliced (one leaf of extra memory).
    owned = jax.tree.map(jnp.copy, params)
    donated = unstack_layer_params(owned, donate=True)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(owned["layers"]))
    for got, want in zip(jax.tree.leaves(donated), jax.tree.leaves(per_layer), strict=True):
        np.testing.assert_array_equal(got, want)


def test_params_and_pool_layouts_must_agree():
    cfg = TINY_CONFIGS["llama3_rope_scaling"]
    params = random_params(cfg, seed=3)
    forward = make_forward(cfg)
    batch = pack_batch([SeqChunk([1, 2, 3], 0, table(1))], 4)
    scanned_pool = PagedRunner(cfg, params).pool
    unrolled_pool = PagedRunner(cfg, unstack_layer_params(params)).pool
    with pytest.raises(TypeError, match="per-layer layers need a LayeredKVPool"):
        forward(unstack_layer_params(params), scanned_pool, batch)
    with pytest.raises(TypeError, match="stacked layers need a KVPool"):
        forward(params, unrolled_pool, batch)


def test_one_setting_lays_out_params_both_ways_and_back():
    model = load_model("smollm2-135m", load_format="dummy", dtype="float32",
                       config=TINY_CONFIGS["llama2_tied_mha"], unroll_layers=True)
    assert model.unroll_layers and isinstance(model.params["layers"], tuple)
    stacked = model.with_layer_layout(False)
    assert not stacked.unroll_layers
    assert stacked.with_layer_layout(False) is stacked  # nothing to do: the same object
    again = stacked.with_layer_layout(True)
    for got, want in zip(jax.tree.leaves(again.params), jax.tree.leaves(model.params),
                         strict=True):
        np.testing.assert_array_equal(got, want)
