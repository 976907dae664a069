"""``load_format="dummy"``: random weights of a config's real shape, made on the device(s).

As in vLLM, every value is uniform in [-1e-3, 1e-3]: good for timing, meaningless as text.
With a 4-bit quantization (``--quantization awq|gptq``) the projections are made packed, as a
checkpoint stores them (random words, zero points in 0..15, scales keeping the weights in about
that range), so that no float copy of a projection ever exists (a 70B model's would not fit).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.loading.assemble import replicate_kv_heads
from jaxllm.model_config import ModelConfig
from jaxllm.models.llama import param_shapes
from jaxllm.quantization.apply import stand_in_shape
from jaxllm.quantization.config import INT4_METHODS, QuantizationConfig

DUMMY_RANGE = 1e-3
# |q - zero| <= 15, so scales of about DUMMY_RANGE / 8 keep 4-bit weights near DUMMY_RANGE.
DUMMY_INT4_SCALE = DUMMY_RANGE / 8


def _random(key, shape, dtype, part: str | None):
    """A leaf's values: uniform floats, or an Int4Weight's packed words, zeros or scales."""
    if part == "qweight":  # any 32 bits: eight uniform 4-bit values
        return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint32), dtype)
    if part == "zeros":
        return jax.random.randint(key, shape, 0, 16, jnp.int32).astype(dtype)
    if part == "scales":
        return jax.random.uniform(key, shape, dtype, DUMMY_INT4_SCALE / 2, DUMMY_INT4_SCALE)
    return jax.random.uniform(key, shape, dtype, -DUMMY_RANGE, DUMMY_RANGE)


def dummy_params(config: ModelConfig, dtype: Any, seed: int = 0, *,
                 unroll_layers: bool = False,
                 shardings: Callable[[Any], Any] | None = None,
                 checkpoint: ModelConfig | None = None,
                 transform: Callable[[tuple, jax.Array], Any] | None = None,
                 quantization: QuantizationConfig | None = None) -> Any:
    """Random params in the layout ``unroll_layers`` picks (a layer's values are the same in
    either); with ``shardings`` (shapes -> NamedShardings) each device makes only its shard.
    ``checkpoint``: the config before tensor parallelism replicated KV heads; the values are
    then made for it and its K/V columns copied, so that every parallel size runs the same
    model (made whole on one device first: only models with fewer KV heads than devices).
    ``transform(path, array)`` runs on each leaf as soon as it is made (load-time
    quantization). A 4-bit ``quantization`` makes the projections packed (module
    docstring)."""
    int4 = quantization is not None and quantization.method in INT4_METHODS
    if checkpoint is not None and checkpoint != config:
        if int4:
            raise ValueError("dummy 4-bit weights with more devices than KV heads (replicated "
                             "K/V projections) are not supported")
        params = dummy_params(checkpoint, dtype, seed, unroll_layers=unroll_layers)
        params = replicate_kv_heads(params, checkpoint, config)
        if shardings is not None:
            params = jax.device_put(params, shardings(
                jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)))
        return params if transform is None else jax.tree_util.tree_map_with_path(
            transform, params)
    shapes = param_shapes(config, dtype)
    if unroll_layers:
        layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                             shapes["layers"])
        shapes = {**shapes, "layers": (layer,) * config.num_hidden_layers}
    if int4:  # the packed stand-ins' shapes, stacked or per layer as the floats were
        shapes = jax.eval_shape(lambda s: jax.tree_util.tree_map_with_path(
            lambda path, leaf: stand_in_shape(path, leaf, quantization), s), shapes)
    placements = (jax.tree.map(lambda _: None, shapes) if shardings is None
                  else shardings(shapes))
    root = jax.random.key(seed)

    # One program per leaf shape and placement, the layer a traced argument (a 70B model has
    # 560 per-layer leaves of 7 shapes); one call per leaf keeps peak memory at the weights
    # themselves (no f32 staging).
    @functools.cache
    def program(shape, dtype, sharding, stacked, part):
        def values(k, layer):
            if stacked:
                return jnp.stack([_random(jax.random.fold_in(k, i), shape[1:], dtype, part)
                                  for i in range(shape[0])])
            return _random(jax.random.fold_in(k, layer), shape, dtype, part)

        return jax.jit(values, out_shardings=sharding)

    # Keyed by the leaf's name and layer, not its place in the tree.
    def make(path, leaf, sharding):
        # dict keys, then an Int4Weight's part (a field name); layer indices have neither
        names = [str(getattr(k, "key", None) or getattr(k, "name", "")) for k in path]
        part = getattr(path[-1], "name", None)
        key = jax.random.fold_in(root, zlib.crc32("/".join(n for n in names if n).encode()))
        layer = getattr(path[1], "idx", None) if len(path) > 1 else None
        stacked = names[0] == "layers" and layer is None
        if layer is None and not stacked:  # a leaf outside the layers: its own key
            made = jax.jit(lambda k: _random(k, leaf.shape, leaf.dtype, part),
                           out_shardings=sharding)(key)
        else:
            made = program(leaf.shape, leaf.dtype, sharding, stacked, part)(key, layer or 0)
        return made if transform is None else transform(path, made)

    return jax.tree_util.tree_map_with_path(make, shapes, placements)

