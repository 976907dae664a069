"""The Llama family in Flax: one implementation for Llama 2/3, Mistral, Qwen2 and SmolLM2.

The forward is pure: ``forward(params, kv_pool, batch) -> (logits, kv_pool)``. The layer
stack runs one of two ways, set once by ``unroll_layers`` (:mod:`jaxllm.kv_pool`), which
decides the params' and the pool's layouts together:

- scanned: params stacked on a leading layer axis, a stacked :class:`KVPool`; one compiled
  layer body whatever the depth, carrying the hidden state and the pool so that each layer's
  K/V scatter updates the donated pool in place;
- unrolled: ``params["layers"]`` a tuple of per-layer trees (:func:`unstack_layer_params`), a
  :class:`LayeredKVPool`; straight-line code (on GPU a scanned stack's launch blocks the host),
  each layer updating its own pool arrays.

Param tree (scanned: stacked leading axis L under "layers"; kernels are [in, out])::

    embed_tokens/embedding                  [V, H]
    layers/input_layernorm/scale            [L, H]
    layers/attn/qkv_proj/kernel             [L, H, Hkv (G + 2) D]      (+ bias for Qwen2)
    layers/attn/o_proj/kernel               [L, Hq D, H]
    layers/post_attention_layernorm/scale   [L, H]
    layers/mlp/gate_up_proj/kernel          [L, H, F 2]
    layers/mlp/down_proj/kernel             [L, F, H]
    norm/scale                              [H]
    lm_head/kernel                          [H, V]                      (absent when tied)

The fused projections' output columns are ordered so that any contiguous split of them is a
set of whole heads (the tensor-parallel split, :mod:`jaxllm.parallel`, is then the same at
every size): ``qkv_proj`` groups by KV head j, each group the G = Hq / Hkv query heads that
read head j, then k_j, then v_j; ``gate_up_proj`` interleaves (gate_i, up_i) pairs. The
loaders build these orders from Hugging Face's separate projections.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.attention import (
    resolve_backend,
    rope_kv_kernel_applies,
    rope_write_kv_and_attend,
    write_kv_and_attend,
)
from jaxllm.batch import BatchMetadata, pack_batch
from jaxllm.kv_pool import AnyKVPool, KVPool, LayeredKVPool
from jaxllm.layers import Linear
from jaxllm.layers.fp8_kernels import (
    norm_quantizes,
    quantized_input,
    rmsnorm_quantized,
    swiglu_product_dtype,
)
from jaxllm.layers.int4_fusion import (
    Int4Activation,
    attention_prescale_layout,
    gemv_partial_splits,
    merged_prescaled,
    norm_prescale_layout,
    prescaled_gemv,
    rmsnorm_prescaled,
)
from jaxllm.layers.linear import (
    Int4Weight,
    in_dtype,
    int4_kernel,
    resolve_int4_backend,
)
from jaxllm.layers.mlp import swiglu_mlp
from jaxllm.model_config import ModelConfig
from jaxllm.models.rope import apply_rope, rope_cos_sin
from jaxllm.parallel.mesh import mesh_of, pipeline_parallel_size
from jaxllm.parallel.pipeline import pipelined_layers

Dtype = Any


class RMSNorm(nn.Module):
    eps: float
    dtype: Dtype
    # Quantize the output per token for the FP8 projection it feeds, in one kernel with the
    # norm (jaxllm.layers.fp8_kernels): an Fp8Activation instead of an array.
    quantize: bool = False
    # Write the 4-bit GEMV's pre-scaled x (its (word rows a step, pairs)) in one kernel with
    # the norm (jaxllm.layers.int4_fusion): an Int4Activation instead of an array.
    prescale: tuple[int, bool] | None = None

    @nn.compact
    def __call__(self, x: jax.Array, delta: jax.Array | None = None):
        """The norm of ``x`` (an array, or an Fp8Activation / Int4Activation for the next
        projection); with ``delta`` (a block's output), of ``x + delta``: ``(x + delta, the
        norm)``."""
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        if self.prescale is not None:
            return rmsnorm_prescaled(x.astype(self.dtype), scale, self.eps, self.prescale,
                                     resolve_int4_backend("auto") == "pallas_interpret", delta)
        stream = x if delta is None else x + delta
        if self.quantize:
            out = rmsnorm_quantized(stream.astype(self.dtype), scale, self.eps)
        else:
            xf = stream.astype(jnp.float32)
            xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
            out = scale * xf.astype(self.dtype)
        return out if delta is None else (stream, out)


def norm_prescale(x: jax.Array, kernel, mesh: Mesh | None) -> tuple[int, bool] | None:
    """Static: the pre-scaled x's layout the RMSNorm before this projection writes for its
    4-bit GEMV (:func:`jaxllm.layers.int4_fusion.norm_prescale_layout`), or None."""
    if not isinstance(kernel, Int4Weight):
        return None
    return norm_prescale_layout(x, kernel, int4_kernel(x, kernel, mesh=mesh) == "gemv")


def output_prescale(tokens: int, cfg: ModelConfig, kernel,
                    mesh: Mesh | None) -> tuple[int, bool] | None:
    """Static: the pre-scaled x's layout the attention writes for its 4-bit o projection
    (:func:`jaxllm.layers.int4_fusion.attention_prescale_layout`), or None."""
    if not isinstance(kernel, Int4Weight):
        return None
    x = jax.ShapeDtypeStruct((tokens, cfg.q_size), jnp.float32)
    return attention_prescale_layout(tokens, kernel, cfg.head_dim,
                                     int4_kernel(x, kernel, mesh=mesh) == "gemv")


class Attention(nn.Module):
    config: ModelConfig
    dtype: Dtype
    backend: str
    mesh: Mesh | None

    @nn.compact
    def __call__(self, x, kv_pool: KVPool, layer, cos, sin, batch: BatchMetadata):
        cfg = self.config
        dense = lambda n, bias, name: Linear(n, bias, self.dtype, self.mesh, name=name)
        kv_heads = cfg.num_key_value_heads
        group = cfg.num_attention_heads // kv_heads
        params = {} if self.is_initializing() else self.variables["params"]
        qkv_kernel = params.get("qkv_proj", {}).get("kernel")
        # JAXLLM_INT4_FUSION (x pre-scaled for the 4-bit GEMV): the qkv GEMV's split partials
        # summed by the RoPE + KV-write kernel, not by an XLA kernel between them
        splits = 0
        if isinstance(x, Int4Activation) and not cfg.attention_bias and rope_kv_kernel_applies(
                jax.ShapeDtypeStruct((x.shape[0], qkv_kernel.shape[1]), x.dtype), kv_pool,
                self.backend, self.mesh):
            splits = gemv_partial_splits(x, qkv_kernel)
        if splits:
            qkv = prescaled_gemv(x, qkv_kernel, resolve_int4_backend("auto")
                                 == "pallas_interpret", partials=True)  # f32[S, T, N]
        else:
            qkv = dense(cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias, "qkv_proj")(x)
        tokens = qkv.shape[-2]
        # and the decode kernel's splits merged by the kernel that writes the 4-bit o
        # projection's pre-scaled x (its steps one head each)
        o_kernel = params.get("o_proj", {})
        o_prescale = output_prescale(tokens, cfg, o_kernel.get("kernel"), self.mesh)
        attend = dict(scale=cfg.head_dim ** -0.5, sliding_window=cfg.sliding_window,
                      backend=self.backend, merge=o_prescale is None)
        if splits or rope_kv_kernel_applies(qkv, kv_pool, self.backend, self.mesh):
            out, kv_pool = rope_write_kv_and_attend(qkv, cos, sin, kv_pool, layer, batch,
                                                    qkv_dtype=x.dtype if splits else None,
                                                    **attend)
        else:
            qkv = qkv.reshape(-1, kv_heads, group + 2, cfg.head_dim)  # [T, Hkv, G + 2, D]
            q = qkv[:, :, :group].reshape(-1, cfg.num_attention_heads, cfg.head_dim)
            k, v = qkv[:, :, group], qkv[:, :, group + 1]  # [T, Hkv, D] each
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [T, Hq or Hkv, D]
            out, kv_pool = write_kv_and_attend(q, k, v, kv_pool, layer, batch, mesh=self.mesh,
                                               **attend)
        if isinstance(out, tuple):  # the decode kernel's unmerged splits (o, lse)
            out = merged_prescaled(*out, self.dtype, o_prescale[1],
                                   resolve_backend(self.backend).endswith("_interpret"))
        else:
            out = out.reshape(-1, cfg.q_size)  # [T, Hq D]
        if not self.is_initializing():  # FP8: quantized per token in a kernel where picked
            out = quantized_input(out, o_kernel["kernel"], self.mesh)
        return dense(cfg.hidden_size, False, "o_proj")(out), kv_pool


class MLP(nn.Module):
    config: ModelConfig
    dtype: Dtype
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x):  # [T, H] -> [T, H]
        f, x = self.config.intermediate_size, in_dtype(x, self.dtype)
        if self.is_initializing():  # the projections' params: Linear's
            Linear(2 * f, False, self.dtype, self.mesh, name="gate_up_proj")(x)
            Linear(self.config.hidden_size, False, self.dtype, self.mesh, name="down_proj")(
                jnp.zeros((x.shape[0], f), self.dtype))
        params = self.variables["params"]
        gate_up, down = params["gate_up_proj"]["kernel"], params["down_proj"]["kernel"]
        return swiglu_mlp(x, gate_up, down, mesh=self.mesh,
                          product_dtype=swiglu_product_dtype(gate_up, down, self.mesh))


class DecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Dtype
    backend: str
    mesh: Mesh | None = None
    # Unrolled layers: where this layer's input norm adds a block's output in its kernel
    # (JAXLLM_INT4_FUSION), return the MLP's output unadded with the stream, (stream, delta),
    # for the next layer's input norm to add (the carry's structure then changes: not scanned).
    defer_residual: bool = False

    @nn.compact
    def __call__(self, carry, cos, sin, batch: BatchMetadata):
        hidden, kv_pool, layer = carry  # hidden [T, H], or (stream, delta) from the layer before
        stream, delta = hidden if isinstance(hidden, tuple) else (hidden, None)
        eps = self.config.rms_norm_eps
        params = {} if self.is_initializing() else self.variables["params"]

        def norm(name: str, module: str, projection: str):  # RMSNorm before the projection
            kernel = params.get(module, {}).get(projection, {}).get("kernel")
            return RMSNorm(eps, self.dtype, norm_quantizes(stream, kernel, self.mesh),
                           norm_prescale(stream, kernel, self.mesh), name=name)

        input_norm = norm("input_layernorm", "attn", "qkv_proj")
        if delta is None:
            attn_in = input_norm(stream)
        else:
            stream, attn_in = input_norm(stream, delta)
        attention = Attention(self.config, self.dtype, self.backend, self.mesh, name="attn")
        attn_out, kv_pool = attention(attn_in, kv_pool, layer, cos, sin, batch)
        stream, mlp_in = norm("post_attention_layernorm", "mlp", "gate_up_proj")(stream, attn_out)
        mlp_out = MLP(self.config, self.dtype, self.mesh, name="mlp")(mlp_in)
        if self.defer_residual and input_norm.prescale is not None:
            return ((stream, mlp_out), kv_pool, layer + 1), None
        return (stream + mlp_out, kv_pool, layer + 1), None


class LlamaForCausalLM(nn.Module):
    """``apply({"params": p}, kv_pool, batch) -> (logits f32[N, V], kv_pool)``; the same numbers
    for either layer layout (init with a :class:`KVPool`). With ``return_hidden`` it also
    returns every token's final-normed hidden state [T, H] (what pooling reads)."""

    config: ModelConfig
    dtype: Dtype = jnp.float32
    attention_backend: str = "auto"
    mesh: Mesh | None = None  # tensor / pipeline parallel: the params' and pool's mesh
    # Pipeline parallel: micro-batches per step; None: by the step's size
    # (jaxllm.parallel.pipeline.num_micro_batches).
    micro_batches: int | None = None

    @nn.compact
    def __call__(self, kv_pool: AnyKVPool, batch: BatchMetadata, return_hidden: bool = False):
        cfg = self.config
        batch = jax.tree.map(jnp.asarray, batch)  # a host-packed (numpy) batch, run eagerly
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype,
                         param_dtype=self.dtype, name="embed_tokens")
        hidden = embed(batch.input_ids)  # [T, H]
        cos, sin = rope_cos_sin(cfg, batch.positions)  # [T, D] each
        unrolled = (not self.is_initializing()
                    and has_per_layer_params(self.variables["params"]))
        if unrolled != isinstance(kv_pool, LayeredKVPool):
            raise TypeError(
                f"params with {'per-layer' if unrolled else 'stacked'} layers need a "
                f"{'LayeredKVPool' if unrolled else 'KVPool'}, got a {type(kv_pool).__name__}: "
                "make both with the same unroll_layers (jaxllm.kv_pool.new_kv_pool, "
                "LoadedModel.with_layer_layout)")
        stages = pipeline_parallel_size(self.mesh)
        if stages > 1 and not self.is_initializing():
            # Each stage runs its own L / pp layers over its part of the pool: scanned, or
            # unrolled over the stage-major per-layer layout (each leaf [1, ...] in a stage).
            layer = DecoderLayer(cfg, self.dtype, self.attention_backend, self.mesh,
                                 parent=None)
            stage = nn.scan(
                DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_hidden_layers // stages,
            )(cfg, self.dtype, self.attention_backend, self.mesh, parent=None)

            def stage_fn(params, hidden, pool, cos, sin, batch):
                if not unrolled:
                    (hidden, pool, _), _ = stage.apply(
                        {"params": params}, (hidden, pool, jnp.int32(0)), cos, sin, batch)
                    return hidden, pool
                for j, layer_params in enumerate(params):
                    (hidden, one, _), _ = layer.apply(
                        {"params": jax.tree.map(lambda x: x[0], layer_params)},
                        (hidden, pool.layer(j), jnp.int32(0)), cos, sin, batch)
                    pool = pool.replace_layer(j, one)
                return hidden, pool

            hidden, kv_pool = pipelined_layers(stage_fn, self.variables["params"]["layers"],
                                               hidden, kv_pool, cos, sin, batch, self.mesh,
                                               self.micro_batches)
        elif unrolled:
            # Each layer is layer 0 of its own one-layer pool, with its own params' tree.
            layers = self.variables["params"]["layers"]
            layer = DecoderLayer(cfg, self.dtype, self.attention_backend, self.mesh,
                                 defer_residual=True)
            for i in range(cfg.num_hidden_layers):
                (hidden, pool, _), _ = layer.apply(
                    {"params": layers[i]}, (hidden, kv_pool.layer(i), jnp.int32(0)), cos, sin,
                    batch)
                kv_pool = kv_pool.replace_layer(i, pool)
            if isinstance(hidden, tuple):  # the last MLP's output, deferred
                hidden = hidden[0] + hidden[1]
        else:
            layers = nn.scan(
                DecoderLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_hidden_layers,
            )(cfg, self.dtype, self.attention_backend, self.mesh, name="layers")
            (hidden, kv_pool, _), _ = layers((hidden, kv_pool, jnp.int32(0)), cos, sin, batch)
        norm = RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")
        if return_hidden:  # per-token norm: normalising first, then gathering, is the same
            every_token = norm(hidden)  # [T, H]
            hidden = every_token[batch.logits_indices]
        else:
            hidden = norm(hidden[batch.logits_indices])  # [N, H]: the head runs where needed
        if cfg.tie_word_embeddings:
            logits = embed.attend(hidden)
        else:
            logits = Linear(cfg.vocab_size, False, self.dtype, name="lm_head")(hidden)
        if return_hidden:
            return logits.astype(jnp.float32), kv_pool, every_token
        return logits.astype(jnp.float32), kv_pool


ForwardFn = Callable[[Any, AnyKVPool, BatchMetadata], tuple[jax.Array, AnyKVPool]]


def make_forward(config: ModelConfig, dtype: Dtype = jnp.float32,
                 attention_backend: str = "auto", mesh: Mesh | None = None, *,
                 return_hidden: bool = False, micro_batches: int | None = None) -> ForwardFn:
    """The pure forward ``(params, kv_pool, batch) -> (logits f32[N, V], kv_pool)``, plus
    every token's final-normed hidden state [T, H] with ``return_hidden``; the
    layers are scanned for stacked params and unrolled for per-layer params (the pool's
    layout must match: see the module docstring). With ``mesh`` (tensor parallel), params and
    pool are sharded over it (:mod:`jaxllm.parallel`) and attention runs per shard; the
    logits come back split by vocabulary when the LM head is. A mesh with pipeline stages runs
    the layers as :func:`jaxllm.parallel.pipeline.pipelined_layers` over ``micro_batches``
    micro-batches a step (None: chosen by the step's size)."""
    model = LlamaForCausalLM(config, dtype, attention_backend, mesh, micro_batches)

    def forward(params, kv_pool: AnyKVPool, batch: BatchMetadata):
        return model.apply({"params": params}, kv_pool, batch, return_hidden)

    return forward


def has_per_layer_params(params: Any) -> bool:
    """Whether ``params["layers"]`` is one tree per layer (:func:`unstack_layer_params`, the
    unrolled layout) rather than the scanned stack's leaves [L, ...]."""
    return isinstance(params["layers"], (tuple, list))


def stack_layer_params(params: Any) -> Any:
    """The inverse of :func:`unstack_layer_params`: per-layer trees back into the scanned
    stack's leaves [L, ...] (new arrays)."""
    if not has_per_layer_params(params):
        return params
    if pipeline_parallel_size(mesh_of(params["layers"])) > 1:  # L / P x [P, ...] -> [L, ...]
        layers = jax.tree.map(lambda *xs: jax.jit(
            lambda *xs: jnp.stack(xs, axis=1).reshape(-1, *xs[0].shape[1:]),
            out_shardings=xs[0].sharding)(*xs), *params["layers"])
    else:
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"])
    return {**params, "layers": layers}


def unstack_layer_params(params: Any, *, donate: bool = False) -> Any:
    """``params`` with the scanned stack's ``layers`` (leaves [L, ...]) as a tuple of L
    per-layer trees, for the unrolled stack. Sliced from the stack inside the step, every
    layer's matmul is a different fusion to XLA (the slice offset is part of it), so its GEMM
    autotuner runs once per layer and bucket; over whole arrays the L layers' fusions are
    identical and are tuned once. Returns new arrays. With ``donate`` (the caller owns
    ``params``) each stacked leaf is deleted once sliced, so the copy needs one leaf of extra
    device memory instead of all the layers' weights. Split over P pipeline stages, tree j
    holds layer j of every stage, leaves [P, ...] split over them (each stage's own j-th)."""
    if has_per_layer_params(params):
        return params
    leaves, treedef = jax.tree.flatten(params["layers"])
    num_layers = leaves[0].shape[0]
    stages = pipeline_parallel_size(mesh_of(params["layers"]))
    count = num_layers // stages  # trees
    per_leaf = []
    for leaf in leaves:
        if stages > 1:  # [L, ...] -> [P, L / P, ...][:, j], staying on each stage's devices
            take = jax.jit(lambda x, j: x.reshape(stages, count, *x.shape[1:])[:, j],
                           static_argnums=1, out_shardings=leaf.sharding)
            per_leaf.append(jax.block_until_ready([take(leaf, j) for j in range(count)]))
        else:
            per_leaf.append(jax.block_until_ready([leaf[i] for i in range(num_layers)]))
        if donate:
            leaf.delete()
    layers = tuple(jax.tree.unflatten(treedef, [parts[i] for parts in per_leaf])
                   for i in range(count))
    return {**params, "layers": layers}


def param_shapes(config: ModelConfig, dtype: Dtype) -> Any:
    """Param tree of ``jax.ShapeDtypeStruct`` without allocating anything."""
    model = LlamaForCausalLM(config, dtype)
    kv = KVPool.zeros(config.num_hidden_layers, 2, 1, config.num_key_value_heads,
                      config.head_dim, dtype)
    batch = pack_batch([], 1, num_tokens=1, num_seqs=1, table_width=1, num_logits=1)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), kv, batch))
    return shapes["params"]
