"""``generate``: the whole prefill + decode loop as one pure, jit-compatible function.

For research code that wants sampling inside its own ``jax.jit`` / ``jax.vmap``: no host
round-trips, no Python state. It runs the same model forward and paged KV pool as the engine,
giving each row a contiguous run of blocks in a private pool.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxllm.batch import SeqChunks, pack_batch
from jaxllm.kv_pool import new_kv_pool
from jaxllm.model_config import ModelConfig
from jaxllm.models.llama import has_per_layer_params, make_forward
from jaxllm.parallel import mesh_of
from jaxllm.sampler_rows import SampleVariant, scalar_variant
from jaxllm.sampling import SamplingMetadata, sample


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # i32[B, max_new_tokens]; pad_token_id after a row stops
    num_tokens: jax.Array  # i32[B] tokens generated per row (an EOS that stopped it included)
    logprobs: jax.Array  # f32[B, max_new_tokens] log p(token) under the unmodified model


def _static_sampler_variant(jitted):
    """Calls ``jitted`` with the sampler's static ``variant`` chosen from the sampling arguments
    while they are still Python numbers (``scalar_variant``; under ``jit`` they would be
    tracers): a greedy call compiles no random draw, neutral penalties no token counts, no
    top-k/top-p no vocabulary sort. An int seed becomes u32 (modulo 2**32, as the engine's)."""
    names = ("temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty")
    defaults = {k: p.default for k, p in inspect.signature(jitted).parameters.items()
                if k in names}

    def prepare(args: tuple, kwargs: dict) -> dict:
        if isinstance(kwargs.get("seed"), numbers.Integral):
            kwargs = kwargs | {"seed": np.uint32(int(kwargs["seed"]) & 0xFFFFFFFF)}
        settings = defaults | {k: v for k, v in kwargs.items() if k in names}
        if "mesh" not in kwargs:  # sharded params (tensor parallel) bring their mesh
            kwargs = kwargs | {"mesh": mesh_of(args[0] if args else kwargs.get("params"))}
        return kwargs | {"variant": scalar_variant(**settings)}

    @functools.wraps(jitted)
    def call(*args, **kwargs):
        return jitted(*args, **prepare(args, kwargs))

    call.lower = lambda *args, **kwargs: jitted.lower(*args, **prepare(args, kwargs))
    return call


@_static_sampler_variant
@functools.partial(jax.jit, static_argnames=(
    "config", "max_new_tokens", "eos_token_ids", "block_size", "pad_token_id",
    "attention_backend", "variant", "mesh"))
def generate(
    params: Any,
    prompt_ids: jax.Array,  # i32[B, P] right-padded
    prompt_lens: jax.Array,  # i32[B] each in 1..P
    key: jax.Array,
    *,
    config: ModelConfig,
    max_new_tokens: int,
    temperature: float | jax.Array = 0.0,  # scalar or f32[B]; < 1e-5 = greedy
    top_k: int | jax.Array = 0,  # scalar or i32[B]; 0 = off
    top_p: float | jax.Array = 1.0,  # scalar or f32[B]; 1 = off
    min_p: float | jax.Array = 0.0,  # scalar or f32[B]; 0 = off
    repetition_penalty: float | jax.Array = 1.0,  # scalar or f32[B]; 1 = off
    presence_penalty: float | jax.Array = 0.0,  # scalar or f32[B]; 0 = off
    frequency_penalty: float | jax.Array = 0.0,  # scalar or f32[B]; 0 = off
    min_tokens: int | jax.Array = 0,  # scalar or i32[B]; EOS ids banned below it
    seed: int | jax.Array | None = None,  # scalar or u32[B]; None: drawn from key
    eos_token_ids: tuple[int, ...] = (),
    block_size: int = 16,
    pad_token_id: int = 0,
    attention_backend: str = "auto",
    row_max_new_tokens: jax.Array | None = None,  # i32[B], each in 1..max_new_tokens
    variant: SampleVariant | None = None,  # static; chosen by the wrapper, None = general
    mesh: Mesh | None = None,  # static; the sharded params' mesh, found by the wrapper
) -> GenerateOutput:
    """Generates up to ``max_new_tokens`` per row (or ``row_max_new_tokens[b]`` for row b: one
    compiled program then serves many output lengths); a row stops after emitting an EOS id.

    Params sharded for tensor parallelism (``load_model(..., tensor_parallel_size=N)``,
    :meth:`~jaxllm.LoadedModel.with_tensor_parallel`) run sharded, with the pool split by KV
    head on their mesh, and ``config`` the model's (KV heads as replicated for the mesh).
    Called with concrete params the mesh is found from them; inside your own ``jax.jit`` the
    params are tracers, so pass ``mesh=model.mesh``.

    Sampling is the engine's (``jaxllm.sampling.sample``), with vLLM's meaning for each
    setting: the same prompt, seed and settings draw the same tokens as ``LLM.generate`` or the
    server with those ``SamplingParams``. Row b's token at step s (tokens it generated so far)
    is drawn with the key ``fold_in(key(seed[b]), s)``; without ``seed`` the rows' seeds are
    drawn from ``key``. Penalties count the row's prompt and generated tokens.

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
    forward = make_forward(config, dtype, attention_backend, mesh)
    width = -(-(prompt_width + max_new_tokens) // block_size)
    tables = 1 + jnp.arange(batch_size * width, dtype=jnp.int32).reshape(batch_size, width)
    # Params laid out per layer (LoadedModel.with_layer_layout) run the unrolled stack over a
    # per-layer pool, as the engine does with unroll_layers; stacked params run the scan.
    kv_pool = new_kv_pool(config, 1 + batch_size * width, block_size, dtype,
                          unroll_layers=has_per_layer_params(params), mesh=mesh)
    lens = prompt_lens.astype(jnp.int32)
    as_rows = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), (batch_size,))
    variant = variant or SampleVariant()
    f32 = lambda x: as_rows(x, jnp.float32)
    sampling = SamplingMetadata(  # steps, banned_ids and token_ids are set per step by pick
        temperature=f32(temperature), top_p=f32(top_p), top_k=as_rows(top_k, jnp.int32),
        min_p=f32(min_p), repetition_penalty=f32(repetition_penalty),
        presence_penalty=f32(presence_penalty), frequency_penalty=f32(frequency_penalty),
        seeds=(jax.random.bits(key, (batch_size,), jnp.uint32) if seed is None
               else as_rows(seed, jnp.uint32)),
        steps=jnp.zeros((batch_size,), jnp.int32),
        banned_ids=jnp.zeros((batch_size, 0), jnp.int32),
        token_ids=jnp.zeros((batch_size, 0), jnp.int32),
        num_prompt_tokens=jnp.full((batch_size,), prompt_width, jnp.int32),
        token_bitmask=jnp.zeros((batch_size, 0), jnp.int32))
    min_tokens = as_rows(min_tokens, jnp.int32)
    eos_rows = jnp.broadcast_to(jnp.asarray(eos_token_ids, jnp.int32),
                                (batch_size, len(eos_token_ids)))  # [B, K]
    # Penalties see [B, P + max_new_tokens] ids: the prompt (padding -1), then the output.
    prompt_part = jnp.where(jnp.arange(prompt_width) < lens[:, None], prompt_ids, -1)
    eos = jnp.asarray(eos_token_ids or (-1,), jnp.int32)
    limit = (jnp.full((batch_size,), max_new_tokens, jnp.int32) if row_max_new_tokens is None
             else jnp.clip(row_max_new_tokens.astype(jnp.int32), 1, max_new_tokens))

    rows = jnp.arange(batch_size, dtype=jnp.int32)
    # Prefill: every row's prompt, back to back in one flat batch of B x P tokens (the rest is
    # padding, which writes nothing).
    prefill = pack_batch(SeqChunks(prompt_ids, lens, jnp.zeros_like(lens), tables), block_size,
                         num_tokens=batch_size * prompt_width, num_seqs=batch_size,
                         table_width=width, logits_rows=rows, decode_only=False)
    logits, kv_pool = forward(params, kv_pool, prefill)

    def pick(logits, step, state):  # step: tokens each row generated so far
        tokens, logprobs, done = state
        md = sampling.replace(steps=jnp.full((batch_size,), step, jnp.int32),
                              banned_ids=jnp.where((step < min_tokens)[:, None], eos_rows, -1))
        if variant.use_penalties:
            output_part = jnp.where(jnp.arange(max_new_tokens) < step, tokens, -1)
            md = md.replace(token_ids=jnp.concatenate([prompt_part, output_part], axis=1))
        out = sample(logits, md, **variant._asdict())
        token = out.sampled
        tokens = tokens.at[:, step].set(jnp.where(done, pad_token_id, token))
        logprobs = logprobs.at[:, step].set(jnp.where(done, 0.0, out.logprob))
        return tokens, logprobs, done | jnp.isin(token, eos) | (step + 1 >= limit)

    state = (jnp.full((batch_size, max_new_tokens), pad_token_id, jnp.int32),
             jnp.zeros((batch_size, max_new_tokens), jnp.float32),
             jnp.zeros((batch_size,), bool))
    state = pick(logits, 0, state)

    def decode_step(carry):
        step, kv_pool, state = carry
        position = lens + step - 1  # where the previous token goes
        decode = pack_batch(SeqChunks(state[0][:, step - 1], jnp.ones_like(lens), position,
                                      tables), block_size, num_tokens=batch_size,
                            num_seqs=batch_size, table_width=width, logits_rows=rows,
                            decode_only=True)
        logits, kv_pool = forward(params, kv_pool, decode)
        return step + 1, kv_pool, pick(logits, step, state)

    def not_finished(carry):
        step, _, (_, _, done) = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    _, _, (tokens, logprobs, done) = jax.lax.while_loop(
        not_finished, decode_step, (jnp.int32(1), kv_pool, state))
    is_eos = jnp.isin(tokens, eos) & (jnp.arange(max_new_tokens) < limit[:, None])
    stopped_at = jnp.argmax(is_eos, axis=-1) + 1
    num_tokens = jnp.where(jnp.any(is_eos, axis=-1), stopped_at, limit).astype(jnp.int32)
    return GenerateOutput(tokens, num_tokens, logprobs)
