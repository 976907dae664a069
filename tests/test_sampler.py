"""The one sampler (``jaxllm.sampling``): exact penalties, banned ids, filters' kept sets, seeded
draws, logprobs, and the static variants of the host and of ``generate()``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.sampler_rows import (
    SamplerInput,
    SampleVariant,
    build_sampling_metadata,
    needs_penalties,
    penalty_width,
    sample_variant,
    scalar_variant,
)
from jaxllm.sampling import apply_penalties, sample
from jaxllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05])  # distinct, hand-checkable filter boundaries


def metadata(rows, *, num_rows=None, width=16, banned_width=4):
    return build_sampling_metadata(rows, num_rows or len(rows), width, banned_width)


def run(logits, rows, md, **overrides):
    """sample() with the variant the host would pick for these rows."""
    variant = sample_variant(rows)._replace(**overrides)
    return sample(logits, md, **variant._asdict())


def kept_set(params: SamplingParams, num_draws: int = 2000) -> tuple[set[int], np.ndarray]:
    """Draws num_draws tokens from PROBS (one row per seed) -> (tokens seen, frequencies)."""
    rows = [SamplerInput(params, seed=s, step=s % 7) for s in range(num_draws)]
    logits = jnp.log(jnp.broadcast_to(jnp.asarray(PROBS, jnp.float32), (num_draws, 5)))
    sampled = np.asarray(run(logits, rows, metadata(rows, width=0)).sampled)
    freq = np.bincount(sampled, minlength=5) / num_draws
    return set(np.flatnonzero(freq).tolist()), freq


# ------------------------------------------------------------------------------ penalties

LOGITS_6 = np.array([2.0, -1.0, 0.5, -0.5, 3.0, 1.0], np.float32)


def penalised(params: SamplingParams, token_ids, num_prompt: int) -> np.ndarray:
    rows = [SamplerInput(params, 0, 0, token_ids=token_ids, num_prompt_tokens=num_prompt)]
    md = metadata(rows, width=8)
    return np.asarray(apply_penalties(jnp.asarray(LOGITS_6)[None], md))[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    out = penalised(SamplingParams(repetition_penalty=2.0), [0, 1, 2, 2], 2)
    np.testing.assert_array_equal(out, [1.0, -2.0, 0.25, -0.5, 3.0, 1.0])


def test_repetition_penalty_hits_prompt_tokens_too():
    out = penalised(SamplingParams(repetition_penalty=2.0), [4, 3], 2)  # prompt only
    np.testing.assert_array_equal(out, [2.0, -1.0, 0.5, -1.0, 1.5, 1.0])


def test_frequency_penalty_counts_output_occurrences_only():
    out = penalised(SamplingParams(frequency_penalty=0.5), [0, 3, 3, 1, 3], 1)
    np.testing.assert_array_equal(out, [2.0, -1.5, 0.5, -2.0, 3.0, 1.0])  # 3: -1.5, 1: -0.5


def test_presence_penalty_subtracts_once_per_output_token():
    out = penalised(SamplingParams(presence_penalty=0.25), [0, 3, 3, 1, 3], 1)
    np.testing.assert_array_equal(out, [2.0, -1.25, 0.5, -0.75, 3.0, 1.0])


def test_penalties_compose_repetition_then_frequency_then_presence():
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    out = penalised(params, [5, 4, 4], 1)  # prompt [5], output [4, 4]
    # 4: 3 / 1.5 - 0.5 * 2 - 0.25 = 0.75; 5 (prompt): 1 / 1.5; the rest untouched.
    np.testing.assert_allclose(out, [2.0, -1.0, 0.5, -0.5, 0.75, 1 / 1.5], rtol=1e-6)


def test_penalties_are_per_row_and_ignore_padding():
    rows = [SamplerInput(SamplingParams(frequency_penalty=1.0), 0, 0, token_ids=[2, 2],
                      num_prompt_tokens=0),
            SamplerInput(SamplingParams(), 0, 0, token_ids=[2, 2], num_prompt_tokens=0)]
    md = metadata(rows, num_rows=4, width=8)
    assert np.asarray(md.token_ids)[1].tolist() == [-1] * 8  # neutral rows are not copied
    out = np.asarray(apply_penalties(jnp.tile(jnp.asarray(LOGITS_6), (4, 1)), md))
    np.testing.assert_array_equal(out[0], [2.0, -1.0, -1.5, -0.5, 3.0, 1.0])
    np.testing.assert_array_equal(out[1:], np.tile(LOGITS_6, (3, 1)))


def test_penalties_change_the_greedy_choice():
    rows = [SamplerInput(GREEDY.replace(repetition_penalty=2.0), 0, 0, token_ids=[4],
                      num_prompt_tokens=1)]
    md = metadata(rows)
    logits = jnp.asarray(LOGITS_6)[None]
    assert int(sample(logits, md, use_penalties=False).sampled[0]) == 4
    assert int(sample(logits, md, use_penalties=True).sampled[0]) == 0  # 4: 3 -> 1.5 < 2


# ------------------------------------------------------------------------ banned and greedy


def test_banned_ids_are_never_sampled_even_when_most_likely():
    logits = jnp.asarray([[9.0, 8.0, 0.0, 0.0, 0.0, 7.5]] * 500)  # [R, 6]
    rows = [SamplerInput(SamplingParams(temperature=2.0), seed=s, step=0, banned_ids=(0, 1))
            for s in range(499)] + [SamplerInput(GREEDY, 0, 0, banned_ids=(0,))]
    sampled = np.asarray(sample(logits, metadata(rows, width=0)).sampled)
    assert not np.isin(sampled[:499], [0, 1]).any()
    assert len(set(sampled[:499].tolist())) == 4  # the other tokens are all reachable
    assert sampled[499] == 1  # greedy: the best token that is not banned


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = jax.random.normal(jax.random.key(1), (8, 300))  # [R, V]
    rows = [SamplerInput(GREEDY if i % 2 else SamplingParams(top_p=0.5), seed=i, step=3)
            for i in range(7)]  # row 7 is padding: greedy too
    sampled = np.asarray(sample(logits, metadata(rows, num_rows=8, width=0)).sampled)
    argmax = np.asarray(jnp.argmax(logits, axis=-1))
    np.testing.assert_array_equal(sampled[1::2], argmax[1::2])
    greedy_rows = [SamplerInput(GREEDY, 0, 0)] * 8
    for all_greedy in (True, False):  # the static shortcut and the general path agree
        out = run(logits, greedy_rows, metadata(greedy_rows, width=0), all_greedy=all_greedy)
        np.testing.assert_array_equal(np.asarray(out.sampled), argmax)


def test_tiny_temperature_is_greedy():
    logits = jax.random.normal(jax.random.key(2), (4, 50))
    rows = [SamplerInput(SamplingParams(temperature=1e-6), seed=i, step=0) for i in range(4)]
    np.testing.assert_array_equal(np.asarray(sample(logits, metadata(rows, width=0)).sampled),
                                  np.asarray(jnp.argmax(logits, axis=-1)))


# ------------------------------------------------------------------------------- filters


def test_unfiltered_draws_follow_the_distribution():
    seen, freq = kept_set(SamplingParams(), 4000)
    assert seen == {0, 1, 2, 3, 4}
    np.testing.assert_allclose(freq, PROBS, atol=0.03)


def test_temperature_flattens_the_distribution():
    _, freq = kept_set(SamplingParams(temperature=2.0), 4000)
    expected = np.sqrt(PROBS) / np.sqrt(PROBS).sum()
    np.testing.assert_allclose(freq, expected, atol=0.03)


def test_low_temperature_concentrates_on_the_most_likely():
    _, freq = kept_set(SamplingParams(temperature=0.05))
    assert freq[0] > 0.99


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(top_k=1), {0}),
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_k=4), {0, 1, 2, 3}),
    (SamplingParams(top_k=1000), {0, 1, 2, 3, 4}),  # k beyond the vocabulary: off
    (SamplingParams(top_p=0.35), {0}),  # 0.4 alone reaches it
    (SamplingParams(top_p=0.65), {0, 1}),  # mass before token 1 is 0.4 < 0.65, before 2: 0.7
    (SamplingParams(top_p=0.75), {0, 1, 2}),
    (SamplingParams(top_p=0.95), {0, 1, 2, 3}),
    (SamplingParams(min_p=0.3), {0, 1, 2}),  # p >= 0.3 * 0.4 = 0.12
    (SamplingParams(min_p=0.5), {0, 1}),  # p >= 0.2
    (SamplingParams(min_p=1.0), {0}),
    # top-p sees the top-k renormalised mass: 0.4 / 0.85 = 0.47 >= 0.45 keeps token 0 alone
    # (on the full distribution 0.4 < 0.45 would keep token 1 as well).
    (SamplingParams(top_k=3, top_p=0.45), {0}),
    # vLLM's order: min-p before top-p; 0.4 / 0.85 >= 0.45 again keeps token 0 alone.
    (SamplingParams(min_p=0.3, top_p=0.45), {0}),
])
def test_filters_keep_exactly_the_right_tokens(params, expected):
    seen, _ = kept_set(params)
    assert seen == expected


def test_top_k_draws_follow_the_renormalised_distribution():
    _, freq = kept_set(SamplingParams(top_k=2), 4000)
    np.testing.assert_allclose(freq[:2], PROBS[:2] / PROBS[:2].sum(), atol=0.03)


# ----------------------------------------------------------------------------- seeded draws


@pytest.mark.parametrize("use_top_k_top_p", [False, True])
def test_without_filters_the_draw_is_the_rows_plain_categorical(use_top_k_top_p):
    # Filters off: the sort-free variant, and the sorting one (kept for another row), must
    # draw exactly what a categorical with the row's key draws, tail tokens included.
    logits = jnp.log(jnp.array([[0.6, 0.4 - 1e-9, 1e-9], [0.2, 0.3, 0.5]]))  # [R, V]
    temperature = np.array([1.0, 0.7], np.float32)
    for seed in range(20):
        rows = [SamplerInput(SamplingParams(temperature=float(t)), seed=seed + 100 * r, step=r)
                for r, t in enumerate(temperature)]
        got = run(logits, rows, metadata(rows, width=0), use_top_k_top_p=use_top_k_top_p)
        keys = [jax.random.fold_in(jax.random.key(row.seed), row.step) for row in rows]
        expected = [jax.random.categorical(k, logits[r] / temperature[r])
                    for r, k in enumerate(keys)]
        np.testing.assert_array_equal(np.asarray(got.sampled), expected)


def test_a_seed_and_step_draw_the_same_token_in_any_batch_row_or_bucket():
    vocab = 1000
    base = jax.random.normal(jax.random.key(3), (vocab,))  # the same logits for every row
    rows = [SamplerInput(SamplingParams(temperature=1.5), seed=1000 + i, step=i * 3)
            for i in range(6)]

    def draw(batch, num_rows, extra=()):
        batch = list(batch) + list(extra)
        logits = jnp.broadcast_to(base, (num_rows, vocab))
        md = metadata(batch, num_rows=num_rows, width=0)
        return np.asarray(run(logits, batch, md).sampled)

    together = draw(rows, 8)[:6]
    alone = [draw([row], 1)[0] for row in rows]
    reversed_ = draw(rows[::-1], 16)[:6][::-1]
    # Another row needing top-p makes the batch sort the vocabulary: no effect on the others.
    with_sort = draw(rows, 8, extra=[SamplerInput(SamplingParams(top_p=0.3), 5, 5)])[:6]
    np.testing.assert_array_equal(together, alone)
    np.testing.assert_array_equal(together, reversed_)
    np.testing.assert_array_equal(together, with_sort)
    assert len(set(together.tolist())) > 1  # different (seed, step) pairs draw differently
    next_step = [SamplerInput(r.params, r.seed, r.step + 1) for r in rows]
    assert (draw(next_step, 8)[:6] != together).any()


# ------------------------------------------------------------------------------- logprobs


def test_logprobs_are_the_raw_log_softmax_and_top_k_is_sorted():
    logits = jax.random.normal(jax.random.key(4), (4, 64)) * 3  # [R, V]
    rows = [SamplerInput(SamplingParams(repetition_penalty=2.0, top_k=5), seed=i, step=0,
                      banned_ids=(int(jnp.argmax(logits[i])),), token_ids=[1, 2, 3],
                      num_prompt_tokens=1) for i in range(3)]
    out = sample(logits, metadata(rows, num_rows=4), num_logprobs=5, use_penalties=True)
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    sampled = np.asarray(out.sampled)
    np.testing.assert_allclose(np.asarray(out.logprob), raw[np.arange(4), sampled], atol=1e-5)
    top_ids = np.asarray(out.top_ids)
    np.testing.assert_array_equal(top_ids, np.argsort(-raw, axis=-1)[:, :5])
    top = np.asarray(out.top_logprobs)
    np.testing.assert_allclose(top, np.take_along_axis(raw, top_ids, -1), atol=1e-5)
    assert (np.diff(top, axis=-1) <= 0).all()
    assert out.top_ids.dtype == jnp.int32 and top.shape == (4, 5)
    # The banned argmax is never sampled, though it is still reported among the top logprobs.
    assert (sampled[:3] != top_ids[:3, 0]).all()
    assert sample(logits, metadata(rows, num_rows=4)).top_ids.shape == (4, 0)


def test_two_stage_top_logprobs_equal_lax_top_k_ties_included():
    logits = jnp.round(jax.random.normal(jax.random.key(7), (3, 4096)) * 4) / 4  # many ties
    out = sample(logits, metadata([SamplerInput(GREEDY, 0, 0)] * 3, width=0), num_logprobs=20)
    values, ids = jax.lax.top_k(logits, 20)
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.asarray(ids))
    np.testing.assert_allclose(np.asarray(out.top_logprobs),
                               np.asarray(values - jax.nn.logsumexp(logits, -1)[:, None]))


def test_no_penalty_variant_equals_the_penalty_variant_when_penalties_are_neutral():
    logits = jax.random.normal(jax.random.key(5), (8, 200))
    params = [SamplingParams(), GREEDY, SamplingParams(top_k=7), SamplingParams(top_p=0.8),
              SamplingParams(min_p=0.2, temperature=0.7)]
    rows = [SamplerInput(p, seed=i, step=i, banned_ids=(i,), token_ids=list(range(i, 40)),
                      num_prompt_tokens=5) for i, p in enumerate(params)]
    with_counts = build_sampling_metadata(rows, 8, 64, 2)
    # Neutral rows skip the token copy; force it to exercise the scatter-add anyway.
    with_counts = with_counts.replace(token_ids=np.tile(np.arange(64, dtype=np.int32), (8, 1)))
    slow = sample(logits, with_counts, num_logprobs=3, use_penalties=True)
    fast = sample(logits, metadata(rows, num_rows=8, width=0, banned_width=2), num_logprobs=3)
    for a, b in zip(jax.tree.leaves(slow), jax.tree.leaves(fast), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sample_traces_inside_an_outer_jit():
    rows = [SamplerInput(SamplingParams(top_p=0.9), 1, 2), SamplerInput(GREEDY, 3, 4)]
    md = metadata(rows, width=0)

    @jax.jit
    def step(x, md):  # stands in for forward + sample
        return sample(x * 2.0, md, num_logprobs=2).sampled

    logits = jax.random.normal(jax.random.key(6), (2, 32))
    assert step(logits, md).shape == (2,)
    assert int(step(logits, md)[1]) == int(jnp.argmax(logits[1]))


# ------------------------------------------------------------------------------ host side


def test_build_pads_rows_greedy_and_neutral():
    rows = [SamplerInput(SamplingParams(temperature=0.5, top_k=3, seed=9), seed=2**32 + 9, step=4,
                      banned_ids=(2, 7), token_ids=[5, 6], num_prompt_tokens=1)]
    md = build_sampling_metadata(rows, 4, 0, 3)
    assert md.temperature.tolist() == [0.5, 0, 0, 0] and md.top_k.tolist() == [3, 0, 0, 0]
    assert md.top_p.tolist() == [1, 1, 1, 1] and md.repetition_penalty.tolist() == [1] * 4
    assert md.seeds.dtype == np.uint32 and md.seeds.tolist() == [9, 0, 0, 0]  # mod 2**32
    assert md.banned_ids.tolist() == [[2, 7, -1]] + [[-1] * 3] * 3
    assert md.token_ids.shape == (4, 0)
    with pytest.raises(ValueError, match="num_rows_bucket"):
        build_sampling_metadata(rows * 5, 4, 0, 3)
    with pytest.raises(ValueError, match="banned_width"):
        build_sampling_metadata(rows, 4, 0, 1)
    with pytest.raises(ValueError, match="penalty_width_bucket"):
        build_sampling_metadata([SamplerInput(SamplingParams(presence_penalty=1.0), 0, 0,
                                           token_ids=[1, 2, 3])], 1, 2, 0)


def test_sample_variant_is_the_cheapest_right_one():
    def variant(*params):
        return sample_variant([SamplerInput(p, 0, 0) for p in params])

    assert variant() == SampleVariant(all_greedy=True, use_top_k_top_p=False)
    assert variant(GREEDY, GREEDY.replace(top_k=5)) == SampleVariant(
        all_greedy=True, use_top_k_top_p=False)  # greedy rows ignore top-k
    assert variant(GREEDY, SamplingParams(min_p=0.1)) == SampleVariant(use_top_k_top_p=False)
    assert variant(SamplingParams(top_p=0.9), SamplingParams(logprobs=5)) == SampleVariant(
        num_logprobs=5)
    assert variant(SamplingParams(top_k=3, repetition_penalty=1.2)) == SampleVariant(
        use_penalties=True)


def test_scalar_variant_is_the_cheapest_right_one_for_generate_arguments():
    per_row = jnp.array([0.0, 1.0])  # could hold anything: the general flag
    assert scalar_variant(temperature=0.0) == SampleVariant(all_greedy=True,
                                                            use_top_k_top_p=False)
    assert scalar_variant(temperature=0.0, top_k=5) == SampleVariant(
        all_greedy=True, use_top_k_top_p=False)  # greedy ignores top-k
    assert scalar_variant(temperature=0.7) == SampleVariant(use_top_k_top_p=False)
    assert scalar_variant(temperature=0.7, top_p=0.9) == SampleVariant()
    assert scalar_variant(temperature=0.7, top_k=-1) == SampleVariant(use_top_k_top_p=False)
    assert scalar_variant(temperature=per_row) == SampleVariant(use_top_k_top_p=False)
    assert scalar_variant(temperature=0.7, top_k=jnp.array([0, 3])) == SampleVariant()
    assert scalar_variant(temperature=0.0, presence_penalty=0.5) == SampleVariant(
        use_penalties=True, all_greedy=True, use_top_k_top_p=False)
    assert scalar_variant(temperature=0.0, repetition_penalty=per_row).use_penalties


def test_penalty_width_counts_only_rows_that_need_penalties():
    plain = SamplerInput(SamplingParams(), 0, 0, token_ids=list(range(50)))
    penal = SamplerInput(SamplingParams(frequency_penalty=0.1), 0, 0, token_ids=np.arange(20))
    assert not needs_penalties(plain.params) and needs_penalties(penal.params)
    assert penalty_width([plain]) == 0 and penalty_width([plain, penal]) == 20
