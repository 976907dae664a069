"""``generate``: the whole prefill + decode loop as one pure, jit-compatible function.

For research code that wants sampling inside its own ``jax.jit`` / ``jax.vmap``: no host
round-trips, no Python state. It runs the same model forward and paged KV pool as the engine,
giving each row a contiguous run of blocks in a private pool.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.batch import PAD_SLOT, BatchMetadata, KVPool, LayeredKVPool, slots_for_positions
from jaxllm.model_config import ModelConfig
from jaxllm.models.llama import has_per_layer_params, make_forward
from jaxllm.sampling import sample_tokens


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # i32[B, max_new_tokens]; pad_token_id after a row stops
    num_tokens: jax.Array  # i32[B] tokens generated per row (an EOS that stopped it included)
    logprobs: jax.Array  # f32[B, max_new_tokens] log p(token) under the unmodified model


@functools.partial(jax.jit, static_argnames=(
    "config", "max_new_tokens", "eos_token_ids", "block_size", "pad_token_id",
    "attention_backend"))
def generate(
    params: Any,
    prompt_ids: jax.Array,  # i32[B, P] right-padded
    prompt_lens: jax.Array,  # i32[B] each in 1..P
    key: jax.Array,
    *,
    config: ModelConfig,
    max_new_tokens: int,
    temperature: float | jax.Array = 0.0,  # scalar or f32[B]; 0 = greedy
    top_k: int | jax.Array = 0,  # scalar or i32[B]; 0 = off
    top_p: float | jax.Array = 1.0,  # scalar or f32[B]; 1 = off
    eos_token_ids: tuple[int, ...] = (),
    block_size: int = 16,
    pad_token_id: int = 0,
    attention_backend: str = "auto",
    row_max_new_tokens: jax.Array | None = None,  # i32[B], each in 1..max_new_tokens
) -> GenerateOutput:
    """Generates up to ``max_new_tokens`` per row (or ``row_max_new_tokens[b]`` for row b: one
    compiled program then serves many output lengths); a row stops after emitting an EOS id.

    Example (the embedded default model)::

        >>> import jax, jax.numpy as jnp, jaxllm
        >>> m = jaxllm.load_model()
        >>> ids = m.tokenizer("The capital of France is")["input_ids"]
        >>> out = jaxllm.generate(m.params, jnp.array([ids]), jnp.array([len(ids)]),
        ...                       jax.random.key(0), config=m.config, max_new_tokens=4)
        >>> m.tokenizer.decode(out.tokens[0])
        ' Paris.\\n\\n'
    """
    batch_size, prompt_width = prompt_ids.shape
    dtype = jax.tree.leaves(params)[0].dtype
    forward = make_forward(config, dtype, attention_backend)
    width = -(-(prompt_width + max_new_tokens) // block_size)
    tables = 1 + jnp.arange(batch_size * width, dtype=jnp.int32).reshape(batch_size, width)
    # Params unstacked per layer (unstack_layer_params) run the unrolled stack over a
    # per-layer pool, as the engine does with unroll_layers; stacked params run the scan.
    pool_type = LayeredKVPool if has_per_layer_params(params) else KVPool
    kv_pool = pool_type.zeros(config.num_hidden_layers, 1 + batch_size * width, block_size,
                              config.num_key_value_heads, config.head_dim, dtype)
    lens = prompt_lens.astype(jnp.int32)
    as_rows = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), (batch_size,))
    temperature = as_rows(temperature, jnp.float32)
    top_k, top_p = as_rows(top_k, jnp.int32), as_rows(top_p, jnp.float32)
    eos = jnp.asarray(eos_token_ids or (-1,), jnp.int32)
    limit = (jnp.full((batch_size,), max_new_tokens, jnp.int32) if row_max_new_tokens is None
             else jnp.clip(row_max_new_tokens.astype(jnp.int32), 1, max_new_tokens))

    # Prefill: every row's padded prompt in one flat batch; padding writes nothing.
    pos = jnp.broadcast_to(jnp.arange(prompt_width, dtype=jnp.int32), (batch_size, prompt_width))
    real = pos < lens[:, None]
    prefill = BatchMetadata(
        input_ids=jnp.where(real, prompt_ids, 0).reshape(-1),
        positions=pos.reshape(-1),
        slot_mapping=jnp.where(real, slots_for_positions(tables, pos, block_size),
                               PAD_SLOT).reshape(-1),
        block_tables=tables,
        seq_lens=lens,
        query_start_loc=jnp.arange(batch_size + 1, dtype=jnp.int32) * prompt_width,
        logits_indices=jnp.arange(batch_size, dtype=jnp.int32) * prompt_width
        + jnp.maximum(lens - 1, 0),
        decode_only=False)
    logits, kv_pool = forward(params, kv_pool, prefill)

    def pick(logits, key, step, state):
        tokens, logprobs, done = state
        token = sample_tokens(logits, key, temperature, top_k, top_p)
        logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], -1)[:, 0]
        tokens = tokens.at[:, step].set(jnp.where(done, pad_token_id, token))
        logprobs = logprobs.at[:, step].set(jnp.where(done, 0.0, logprob))
        return tokens, logprobs, done | jnp.isin(token, eos) | (step + 1 >= limit)

    key, first_key = jax.random.split(key)
    state = (jnp.full((batch_size, max_new_tokens), pad_token_id, jnp.int32),
             jnp.zeros((batch_size, max_new_tokens), jnp.float32),
             jnp.zeros((batch_size,), bool))
    state = pick(logits, first_key, 0, state)

    def decode_step(carry):
        step, kv_pool, key, state = carry
        position = lens + step - 1  # where the previous token goes
        decode = BatchMetadata(
            input_ids=state[0][:, step - 1],
            positions=position,
            slot_mapping=slots_for_positions(tables, position[:, None], block_size)[:, 0],
            block_tables=tables,
            seq_lens=position + 1,
            query_start_loc=jnp.arange(batch_size + 1, dtype=jnp.int32),
            logits_indices=jnp.arange(batch_size, dtype=jnp.int32),
            decode_only=True)
        logits, kv_pool = forward(params, kv_pool, decode)
        key, step_key = jax.random.split(key)
        return step + 1, kv_pool, key, pick(logits, step_key, step, state)

    def not_finished(carry):
        step, _, _, (_, _, done) = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    _, _, _, (tokens, logprobs, done) = jax.lax.while_loop(
        not_finished, decode_step, (jnp.int32(1), kv_pool, key, state))
    is_eos = jnp.isin(tokens, eos) & (jnp.arange(max_new_tokens) < limit[:, None])
    stopped_at = jnp.argmax(is_eos, axis=-1) + 1
    num_tokens = jnp.where(jnp.any(is_eos, axis=-1), stopped_at, limit).astype(jnp.int32)
    return GenerateOutput(tokens, num_tokens, logprobs)
