"""The jitted programs of one engine step, made once per model shape and shared by every
runner over it.

JAX keeps traced, lowered and compiled programs keyed by the jitted function itself. A runner
that built its own closures would trace and lower every bucket again even when an engine over
the same model already compiled it (a second ``LLM`` in a notebook, a restarted engine, the
test suite's many small engines); with the functions shared, a second runner's compile is a
lookup. Everything a program depends on besides its arguments' shapes, dtypes and shardings is
in :class:`ProgramKey`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.batch import PackedBatch
from jaxllm.env_settings import env_switch
from jaxllm.kv_pool import copy_blocks
from jaxllm.model_config import ModelConfig
from jaxllm.models.llama import make_forward
from jaxllm.models.pooling import pool_hidden
from jaxllm.parallel import kv_pool_shardings, logits_sharding
from jaxllm.sampler_rows import SampleVariant
from jaxllm.sampling import sample

# "on": the forward reads its step's batch from a copy in its own temporaries
# (PackedBatch.staged), at one address from step to step, so that XLA's CUDA graph of the step
# needs only the copy's command re-recorded for a new batch. Off: with XLA's SKIP_TEMP command
# buffers it halved a lone one-row step's launch on an H100, but in an H100's offline FP8 run it
# lengthened the small steps' launch and left throughput as it was (RESULTS.md, 2026-12-06,
# t1fe). Read where the runner makes its ProgramKey, so listed among the executable cache's
# program variables (executable_cache.PROGRAM_ENV).
STAGE_STEP_INPUT_ENV = "JAXLLM_STAGE_STEP_INPUT"


def stage_step_input(environ=os.environ) -> bool:
    """Whether ``JAXLLM_STAGE_STEP_INPUT`` is "on" ("off" when unset); a clear error for any
    other value."""
    return env_switch(environ, STAGE_STEP_INPUT_ENV)


@dataclasses.dataclass(frozen=True)
class ProgramKey:
    config: ModelConfig
    dtype: Any  # the activations' dtype (model.dtype)
    attention_backend: str
    mesh: jax.sharding.Mesh | None  # tensor parallel: pool and logits split over it
    max_rows: int  # the largest row bucket: the sampled-token buffer's size
    stage_input: bool = False  # the forward reads a staged copy of its batch (stage_step_input)


class StepPrograms(NamedTuple):
    # (params, pool, PackedBatch (the batch and prev_rows i32[T] in one buffer),
    #  prev_tokens i32[max_rows]; pooling static)
    #   -> (logits f32[S, V], pool, pooled | None); the pool is donated.
    forward: Any
    # (logits f32[S, V], SamplingMetadata; SampleVariant fields static)
    #   -> (SamplerOutput, tokens i32[max_rows])
    sample: Any
    copy: Any  # (pool, src i32[n], dst i32[n]) -> pool, donated
    write_blocks: Any  # (pool, ids i32[n], k, v) -> pool, donated
    read_blocks: Any  # (pool, ids i32[n]) -> (k, v)


@functools.lru_cache(maxsize=32)
def step_programs(key: ProgramKey) -> StepPrograms:
    cfg, mesh = key.config, key.mesh
    forward = make_forward(cfg, key.dtype, key.attention_backend, mesh)
    # Steps with embedding requests: a variant that also pools the hidden states, compiled
    # on first use (the generation steps' programs stay as they are).
    forward_hidden = make_forward(cfg, key.dtype, key.attention_backend, mesh,
                                  return_hidden=True)

    def pinned(pool):
        """The pool where every program that takes it was compiled to find it."""
        if mesh is None:
            return pool
        return jax.lax.with_sharding_constraint(pool, kv_pool_shardings(pool, mesh))

    def forward_after(params, kv_pool, packed: PackedBatch, prev_tokens, pooling=False):
        if key.stage_input:
            packed = packed.staged()
        batch, prev_rows = packed.unpack()  # one host-to-device copy for all of it
        # Async scheduling: tokens the previous step samples are only on the device; the host
        # marks where they go (prev_rows >= 0) and they are filled in here.
        ids = jnp.where(prev_rows >= 0, prev_tokens[jnp.maximum(prev_rows, 0)],
                        batch.input_ids)
        batch = batch.replace(input_ids=ids)
        pooled = None
        if pooling:
            logits, kv_pool, hidden = forward_hidden(params, kv_pool, batch)
            pooled = pool_hidden(hidden, batch)
        else:
            logits, kv_pool = forward(params, kv_pool, batch)
        if mesh is not None:  # what the sampler was compiled for
            logits = jax.lax.with_sharding_constraint(logits, logits_sharding(mesh, cfg))
        return logits, pinned(kv_pool), pooled

    def sample_padded(logits, md, **variant):
        out = sample(logits, md, **variant)
        tokens = jnp.zeros((key.max_rows,), jnp.int32).at[:out.sampled.shape[0]].set(
            out.sampled)
        return out, tokens

    return StepPrograms(
        forward=jax.jit(forward_after, donate_argnums=(1,), static_argnames="pooling"),
        sample=jax.jit(sample_padded, static_argnames=SampleVariant._fields),
        copy=jax.jit(lambda pool, src, dst: pinned(copy_blocks(pool, src, dst)),
                     donate_argnums=(0,)),
        write_blocks=jax.jit(lambda pool, ids, k, v: pinned(pool.write_blocks(ids, k, v)),
                             donate_argnums=(0,)),
        read_blocks=jax.jit(lambda pool, ids: pool.read_blocks(ids)),
    )
