"""The one sampler: ``jaxllm.generate``, the engine (``LLM``) and the server all sample with
``sample``, so one seed draws the same tokens through any of them.

It runs on device, jitted alone or together with the forward. One row per sequence to
sample, padded to a bucket of R rows. The order follows vLLM V1:

1. raw logprobs: log-softmax of the logits as the model gave them (what ``logprobs`` reports);
2. penalties (``use_penalties`` only): repetition over prompt + output tokens, then frequency and
   presence over output tokens;
3. banned ids (EOS and stop token ids while fewer than ``min_tokens`` are generated) -> -inf;
   then the grammar's token bitmask (``use_bitmask`` only; structured outputs): a token the
   grammar does not allow -> -inf (where the two leave nothing, the grammar wins);
4. greedy rows (temperature < 1e-5) take the argmax here;
5. temperature, min-p, then top-k and top-p on what is left;
6. a Gumbel-max draw with the row's own key ``fold_in(key(seed), step)``, so a seeded sequence
   draws the same tokens whatever batch, bucket or row it lands in.

Everything has static shapes and no host sync. What a batch needs is decided where the rows'
settings are known and passed as static flags (``sample_variant`` for the engine's rows,
``scalar_variant`` for ``generate``'s arguments): an all-greedy batch pays for an argmax only,
and the vocabulary sort runs only when a random row uses top-k or top-p.
The host side that builds a step's rows into this pytree is ``jaxllm.sampler_rows``.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jaxllm.sampling_params import GREEDY_TEMPERATURE

PAD_ID = -1  # padding in banned_ids and token_ids


@flax.struct.dataclass
class SamplingMetadata:
    """Per-row sampling inputs of one step; padding rows are greedy and penalty-free."""

    temperature: jax.Array  # f32[R]  < 1e-5 = greedy
    top_p: jax.Array  # f32[R]  1 = off
    top_k: jax.Array  # i32[R]  0 = off
    min_p: jax.Array  # f32[R]  0 = off
    repetition_penalty: jax.Array  # f32[R]  1 = off; prompt + output tokens
    presence_penalty: jax.Array  # f32[R]  0 = off; output tokens
    frequency_penalty: jax.Array  # f32[R]  0 = off; output tokens
    seeds: jax.Array  # u32[R]  per-sequence seed
    steps: jax.Array  # i32[R]  tokens this sequence has generated so far
    banned_ids: jax.Array  # i32[R, K]  ids that must not be sampled this step, -1 padded
    token_ids: jax.Array  # i32[R, P]  prompt + output ids (penalties only), -1 padded; P may be 0
    num_prompt_tokens: jax.Array  # i32[R]  how many leading token_ids are prompt
    # i32[R, W]  W = ceil(V / 32), or 0 without constrained rows: bit j % 32 of word j // 32
    # set = token j allowed (xgrammar's and llguidance's layout); unconstrained rows are -1.
    token_bitmask: jax.Array


@flax.struct.dataclass
class SamplerOutput:
    """Sampled ids and raw logprobs (log-softmax of the unprocessed logits)."""

    sampled: jax.Array  # i32[R]
    logprob: jax.Array  # f32[R]  raw logprob of the sampled token
    top_ids: jax.Array  # i32[R, num_logprobs]  most likely ids, most likely first
    top_logprobs: jax.Array  # f32[R, num_logprobs]  their raw logprobs, descending


# ----------------------------------------------------------------------------- device side


def _row_mask(ids: jax.Array, vocab: int) -> jax.Array:  # ids i32[R, N] -> bool[R, V]
    """True at each (row, id) listed in ``ids``; negative ids are ignored."""
    rows = jnp.arange(ids.shape[0])[:, None]  # [R, 1]
    cols = jnp.where(ids >= 0, ids, vocab)  # out of range -> dropped
    return jnp.zeros((ids.shape[0], vocab), bool).at[rows, cols].set(True, mode="drop")


def unpack_bitmask(bitmask: jax.Array, vocab: int) -> jax.Array:  # i32[R, W] -> bool[R, V]
    """Token j of a row is allowed where bit j % 32 of word j // 32 is set."""
    shifts = jnp.arange(32, dtype=jnp.int32)  # [32]
    bits = (bitmask[:, :, None] >> shifts[None, None, :]) & 1  # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab] != 0


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:  # f32[R, V]
    """Repetition (prompt + output), frequency and presence (output) penalties, as vLLM."""
    num_rows, vocab = logits.shape
    ids = md.token_ids  # [R, P]
    is_output = jnp.arange(ids.shape[1])[None, :] >= md.num_prompt_tokens[:, None]  # [R, P]
    rows = jnp.arange(num_rows)[:, None]  # [R, 1]
    output_ids = jnp.where((ids >= 0) & is_output, ids, vocab)  # prompt and padding dropped
    counts = jnp.zeros((num_rows, vocab), jnp.float32).at[rows, output_ids].add(
        1.0, mode="drop")  # [R, V]  occurrences in the output
    in_output = counts > 0
    in_prompt = _row_mask(jnp.where(is_output, PAD_ID, ids), vocab)  # [R, V]
    rep = md.repetition_penalty[:, None]  # [R, 1]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(in_prompt | in_output, penalised, logits)
    logits = logits - md.frequency_penalty[:, None] * counts
    return logits - md.presence_penalty[:, None] * in_output.astype(jnp.float32)


def _sort_descending(x: jax.Array) -> jax.Array:  # f32[R, V] -> f32[R, V]
    """Each row sorted, largest first (values only)."""
    # NOTE: sorting order-preserving int32 keys rather than floats (whose comparator orders
    # NaNs) took 704 instead of 1186 us for [256, 49152] on an H200; same values.
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    keys = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # ascending ints = ascending floats
    keys = -jax.lax.sort(-keys, dimension=1)  # descending (-int32 min wraps; it is NaN)
    return jax.lax.bitcast_convert_type(jnp.where(keys < 0, keys ^ 0x7FFFFFFF, keys),
                                        jnp.float32)


def _top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks to -inf what top-k, then top-p (on the top-k renormalised mass), drop. [R, V]."""
    vocab = scaled.shape[-1]
    desc = _sort_descending(scaled)  # [R, V]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [R]
    desc = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)  # [R, V]
    # Keep a token while the mass strictly before it is < top_p: the smallest prefix reaching
    # top_p (vLLM's rule); the most likely token always stays.
    before = jnp.cumsum(probs, axis=-1) - probs
    num_keep = jnp.sum(before < top_p[:, None], axis=-1)  # [R]  >= 1
    num_keep = jnp.where(top_p >= 1.0, k, jnp.clip(num_keep, 1, k))  # top_p=1: no rounding loss
    cutoff = jnp.take_along_axis(desc, (num_keep - 1)[:, None], axis=-1)  # [R, 1]
    # Ties with the cutoff value are all kept.
    return jnp.where(scaled < cutoff, -jnp.inf, scaled)


def _draw(logits: jax.Array, seeds: jax.Array, steps: jax.Array) -> jax.Array:  # i32[R]
    """One categorical draw per row from its own key fold_in(key(seed), step)."""

    def one(logits_row, seed, step):  # [V], u32[], i32[]
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.categorical(key, logits_row)

    return jax.vmap(one)(logits, seeds, steps).astype(jnp.int32)


def _random_sample(logits: jax.Array, md: SamplingMetadata, greedy: jax.Array,
                   use_top_k_top_p: bool) -> jax.Array:
    """Temperature, min-p, top-k/top-p and the seeded draw, for every row. i32[R]."""
    scaled = logits / jnp.where(greedy, 1.0, md.temperature)[:, None]  # [R, V]
    # min-p: drop p_i < min_p * p_max, i.e. s_i - s_max < log(min_p) (no softmax needed).
    max_scaled = jnp.max(scaled, axis=-1, keepdims=True)  # [R, 1]
    log_min_p = jnp.log(md.min_p)[:, None]  # [R, 1]  -inf for min_p = 0
    scaled = jnp.where(scaled - max_scaled < log_min_p, -jnp.inf, scaled)
    if use_top_k_top_p:
        scaled = _top_k_top_p(scaled, md.top_k, md.top_p)
    return _draw(scaled, md.seeds, md.steps)


def _top_logprobs(logits: jax.Array, num: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k over the vocabulary, in two stages: per block of 256, then over the blocks'
    winners. Exact, same order (ties by id). -> (f32[R, num], i32[R, num])."""
    num_rows, vocab = logits.shape
    block = 256
    if vocab % block or vocab <= 4 * block:
        values, ids = jax.lax.top_k(logits, num)
        return values, ids.astype(jnp.int32)
    # NOTE: [256, 49152], k=20 on an H200: 711 us in two stages, 1163 us for one lax.top_k.
    values, ids = jax.lax.top_k(logits.reshape(num_rows, vocab // block, block), num)
    ids = ids + jnp.arange(0, vocab, block, dtype=ids.dtype)[None, :, None]  # [R, V/256, num]
    values, which = jax.lax.top_k(values.reshape(num_rows, -1), num)  # [R, num]
    ids = jnp.take_along_axis(ids.reshape(num_rows, -1), which, axis=-1)
    return values, ids.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "num_logprobs", "use_penalties", "all_greedy", "use_top_k_top_p", "use_bitmask"))
def sample(
    logits: jax.Array,  # f32[R, V] (any float dtype)
    md: SamplingMetadata,
    *,
    num_logprobs: int = 0,
    use_penalties: bool = False,
    all_greedy: bool = False,
    use_top_k_top_p: bool = True,
    use_bitmask: bool = False,
) -> SamplerOutput:
    """Samples one token per row (see the module docstring for the order of the steps).

    The keyword arguments are static (one compilation per combination) and come from the
    host, where the rows' params are known (``sample_variant``):
    ``num_logprobs`` (0..20) sizes ``top_ids``/``top_logprobs``; ``use_penalties=False`` skips
    all [R, V] count work and ignores ``md.token_ids``; ``all_greedy=True`` skips the random
    path (every row must be greedy); ``use_top_k_top_p=False`` skips the vocabulary sort (no
    random row may use top-k or top-p); ``use_bitmask=True`` applies ``md.token_bitmask``
    (needed when any row is constrained). The defaults are right for any unconstrained rows.
    """
    if not 0 <= num_logprobs <= 20:
        raise ValueError(f"{num_logprobs=} must be in [0, 20]")
    logits = logits.astype(jnp.float32)  # [R, V]
    num_rows, vocab = logits.shape
    log_norm = jax.nn.logsumexp(logits, axis=-1)  # [R]  raw logprob = logit - log_norm

    processed = apply_penalties(logits, md) if use_penalties else logits
    unbanned = processed
    if md.banned_ids.shape[1]:
        processed = jnp.where(_row_mask(md.banned_ids, vocab), -jnp.inf, processed)
    if use_bitmask:
        allowed = unpack_bitmask(md.token_bitmask, vocab)  # [R, V]
        # A grammar that allows only what min_tokens bans (say, EOS once the JSON is done)
        # wins: its row keeps the grammar's tokens.
        constrained = jnp.where(allowed, processed, -jnp.inf)
        possible = jnp.any(constrained > -jnp.inf, axis=-1, keepdims=True)  # [R, 1]
        processed = jnp.where(possible, constrained, jnp.where(allowed, unbanned, -jnp.inf))
    greedy = md.temperature < GREEDY_TEMPERATURE  # [R]
    sampled = jnp.argmax(processed, axis=-1).astype(jnp.int32)  # [R]
    # NOTE: these branches are static, not lax.cond: on GPU a cond reads its predicate back
    # to the host, which blocked each call until the forward had run (measured on an H200).
    if not all_greedy:
        random_ids = _random_sample(processed, md, greedy, use_top_k_top_p)
        sampled = jnp.where(greedy, sampled, random_ids)

    logprob = jnp.take_along_axis(logits, sampled[:, None], axis=-1)[:, 0] - log_norm
    if num_logprobs:
        top_values, top_ids = _top_logprobs(logits, num_logprobs)  # [R, N] each
        top_logprobs = top_values - log_norm[:, None]
    else:
        top_ids = jnp.zeros((num_rows, 0), jnp.int32)
        top_logprobs = jnp.zeros((num_rows, 0), jnp.float32)
    return SamplerOutput(sampled=sampled, logprob=logprob, top_ids=top_ids,
                         top_logprobs=top_logprobs)
