"""jaxllm.generate: pure, jit-compatible, and equal to the step-by-step paged path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import TINY_CONFIGS, PagedRunner, random_params

import jaxllm
from jaxllm import SeqChunk
from jaxllm.models.llama import unstack_layer_params

CFG = TINY_CONFIGS["llama3_rope_scaling"]
PROMPTS = [[5, 17, 99, 3, 42, 8, 1], [7, 7, 21], [100, 2, 64, 33, 90]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=11)


def padded(prompts):
    ids = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    return jnp.asarray(ids), jnp.asarray([len(p) for p in prompts], jnp.int32)


def greedy_step_by_step(params, prompt, steps, block_size=4):
    """Host loop: prefill, then one decode step at a time through the paged forward."""
    runner = PagedRunner(CFG, params, block_size=block_size)
    blocks = list(range(1, 1 + -(-(len(prompt) + steps) // block_size)))
    seq = list(prompt)
    logits = runner.step([SeqChunk(seq, 0, blocks)])[-1]
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(logits)))
        logits = runner.step([SeqChunk([out[-1]], len(seq), blocks)])[0]
        seq.append(out[-1])
    return out


def test_generate_inside_user_jit_equals_step_by_step(params):
    @jax.jit
    def user_code(params, ids, lens, key):
        out = jaxllm.generate(params, ids, lens, key, config=CFG, max_new_tokens=MAX_NEW,
                              block_size=4)
        return out.tokens, jnp.sum(out.logprobs, axis=-1)

    tokens, total_logprob = user_code(params, *padded(PROMPTS), jax.random.key(0))
    for i, prompt in enumerate(PROMPTS):
        assert np.asarray(tokens[i]).tolist() == greedy_step_by_step(params, prompt, MAX_NEW)
    assert np.all(np.asarray(total_logprob) < 0)


def test_per_layer_params_run_the_unrolled_stack_with_the_same_samples(params):
    per_layer = unstack_layer_params(params)
    run = lambda p: jaxllm.generate(p, *padded(PROMPTS), jax.random.key(3), config=CFG,
                                    max_new_tokens=MAX_NEW, temperature=0.8, block_size=4)
    scanned, unrolled = run(params), run(per_layer)
    np.testing.assert_array_equal(unrolled.tokens, scanned.tokens)
    np.testing.assert_allclose(unrolled.logprobs, scanned.logprobs, atol=1e-5)
    loops = lambda p: jax.jit(lambda p: run(p).tokens).lower(p).as_text().count(
        "stablehlo.while")
    assert loops(per_layer) == loops(params) - 2  # no layer loop in prefill nor decode


def test_eos_stops_a_row_and_pads_after_it(params):
    ids, lens = padded(PROMPTS)
    free = jaxllm.generate(params, ids, lens, jax.random.key(0), config=CFG,
                           max_new_tokens=MAX_NEW, block_size=4)
    eos = int(free.tokens[0, 3])  # make row 0's fourth token an EOS id
    out = jaxllm.generate(params, ids, lens, jax.random.key(0), config=CFG,
                          max_new_tokens=MAX_NEW, block_size=4, eos_token_ids=(eos,),
                          pad_token_id=-1)
    row = np.asarray(out.tokens[0]).tolist()
    first = row.index(eos)
    assert first <= 3 and int(out.num_tokens[0]) == first + 1
    assert row[:first + 1] == np.asarray(free.tokens[0]).tolist()[:first + 1]
    assert all(t == -1 for t in row[first + 1:])
    assert np.all(np.asarray(out.logprobs[0, first + 1:]) == 0)
    for i in range(1, len(PROMPTS)):
        free_row = np.asarray(free.tokens[i]).tolist()
        n = int(out.num_tokens[i])
        assert np.asarray(out.tokens[i]).tolist()[:n] == free_row[:n]


def test_row_max_new_tokens_stops_each_row_at_its_own_length(params):
    ids, lens = padded(PROMPTS)
    free = jaxllm.generate(params, ids, lens, jax.random.key(0), config=CFG,
                           max_new_tokens=MAX_NEW, block_size=4)
    limits = jnp.asarray([3, MAX_NEW, 1], jnp.int32)
    out = jaxllm.generate(params, ids, lens, jax.random.key(0), config=CFG,
                          max_new_tokens=MAX_NEW, block_size=4, pad_token_id=-1,
                          row_max_new_tokens=limits)
    assert np.asarray(out.num_tokens).tolist() == [3, MAX_NEW, 1]
    for i, n in enumerate([3, MAX_NEW, 1]):
        row = np.asarray(out.tokens[i]).tolist()
        assert row[:n] == np.asarray(free.tokens[i]).tolist()[:n]
        assert row[n:] == [-1] * (MAX_NEW - n)
    # An EOS before the row's limit still stops it, and counts.
    eos = int(free.tokens[1, 2])
    out = jaxllm.generate(params, ids, lens, jax.random.key(0), config=CFG,
                          max_new_tokens=MAX_NEW, block_size=4, eos_token_ids=(eos,),
                          row_max_new_tokens=limits)
    first = np.asarray(free.tokens[1]).tolist().index(eos)
    assert int(out.num_tokens[1]) == first + 1


def test_sampling_is_reproducible_and_key_dependent(params):
    ids, lens = padded(PROMPTS)
    sample = lambda seed, **kw: np.asarray(jaxllm.generate(
        params, ids, lens, jax.random.key(seed), config=CFG, max_new_tokens=MAX_NEW,
        block_size=4, temperature=1.0, **kw).tokens)
    assert (sample(1) == sample(1)).all()
    assert (sample(1) != sample(2)).any()
    greedy = np.asarray(jaxllm.generate(params, ids, lens, jax.random.key(0), config=CFG,
                                        max_new_tokens=MAX_NEW, block_size=4).tokens)
    assert (sample(3, top_k=1) == greedy).all()
    assert (sample(4, top_p=1e-6) == greedy).all()


def test_per_row_temperature_mixes_greedy_and_sampled_rows(params):
    ids, lens = padded(PROMPTS)
    greedy = np.asarray(jaxllm.generate(params, ids, lens, jax.random.key(0), config=CFG,
                                        max_new_tokens=MAX_NEW, block_size=4).tokens)
    mixed = np.asarray(jaxllm.generate(params, ids, lens, jax.random.key(5), config=CFG,
                                       max_new_tokens=MAX_NEW, block_size=4,
                                       temperature=jnp.array([0.0, 5.0, 0.0])).tokens)
    assert (mixed[[0, 2]] == greedy[[0, 2]]).all()
    assert (mixed[1] != greedy[1]).any()


def test_vmap_over_keys(params):
    ids, lens = padded(PROMPTS[:1])
    run = jax.vmap(lambda k: jaxllm.generate(params, ids, lens, k, config=CFG, max_new_tokens=6,
                                             block_size=4, temperature=1.0).tokens[0])
    samples = np.asarray(run(jax.random.split(jax.random.key(0), 4)))
    assert samples.shape == (4, 6) and len({tuple(s) for s in samples}) > 1
