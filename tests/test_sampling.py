"""sample_tokens: each filter keeps exactly the tokens it should."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sampling import sample_tokens

LOGITS = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))


def draws(n=400, **kw):
    params = dict(temperature=jnp.array([1.0]), top_k=jnp.array([0]), top_p=jnp.array([1.0]))
    params.update({k: jnp.array([v]) for k, v in kw.items()})
    keys = jax.random.split(jax.random.key(0), n)
    fn = jax.jit(jax.vmap(lambda k: sample_tokens(LOGITS, k, **params)[0]))
    return np.bincount(np.asarray(fn(keys)), minlength=4) / n


def test_unfiltered_sampling_follows_the_distribution():
    np.testing.assert_allclose(draws(4000), [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_top_k_keeps_the_k_most_likely():
    freq = draws(top_k=2)
    assert freq[2:].sum() == 0 and freq[0] > freq[1] > 0


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    freq = draws(top_p=0.75)  # 0.5 + 0.3 >= 0.75: two tokens
    assert freq[2:].sum() == 0 and freq[1] > 0
    assert draws(top_p=0.45)[1:].sum() == 0  # the first token alone reaches 0.45


def test_low_temperature_concentrates_and_zero_is_greedy():
    assert draws(temperature=0.05)[0] > 0.99
    assert draws(temperature=0.0)[0] == 1.0


def test_without_top_k_or_top_p_the_draw_is_plain_categorical():
    # No filter requested: the sort-free path must draw exactly what the unfiltered
    # categorical draws with the same key, tail tokens included.
    logits = jnp.log(jnp.array([[0.6, 0.4 - 1e-9, 1e-9], [0.2, 0.3, 0.5]]))
    temperature = jnp.array([1.0, 0.7])
    off = dict(top_k=jnp.array([0, 0]), top_p=jnp.array([1.0, 1.0]))
    for seed in range(20):
        key = jax.random.key(seed)
        expected = jax.random.categorical(key, logits / temperature[:, None], axis=-1)
        got = sample_tokens(logits, key, temperature, **off)
        np.testing.assert_array_equal(got, expected)
