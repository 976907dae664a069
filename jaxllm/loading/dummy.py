"""``load_format="dummy"``: random weights of a config's real shape, made on the device(s).

As in vLLM, every value is uniform in [-1e-3, 1e-3]: good for timing, meaningless as text.
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

DUMMY_RANGE = 1e-3


def dummy_params(config: ModelConfig, dtype: Any, seed: int = 0, *,
                 unroll_layers: bool = False,
                 shardings: Callable[[Any], Any] | None = None,
                 checkpoint: ModelConfig | None = None,
                 transform: Callable[[tuple, jax.Array], Any] | None = None) -> Any:
    """Random params in the layout ``unroll_layers`` picks (a layer's values are the same in
    either); with ``shardings`` (shapes -> NamedShardings) each device makes only its shard.
    ``checkpoint``: the config before tensor parallelism replicated KV heads; the values are
    then made for it and its K/V columns copied, so that every parallel size runs the same
    model (made whole on one device first: only models with fewer KV heads than devices).
    ``transform(path, array)`` runs on each leaf as soon as it is made (load-time
    quantization)."""
    if checkpoint is not None and checkpoint != config:
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
    placements = (jax.tree.map(lambda _: None, shapes) if shardings is None
                  else shardings(shapes))
    root = jax.random.key(seed)

    def uniform(key, shape, dtype):
        return jax.random.uniform(key, shape, dtype, -DUMMY_RANGE, DUMMY_RANGE)

    # One program per leaf shape and placement, the layer a traced argument (a 70B model has
    # 560 per-layer leaves of 7 shapes); one call per leaf keeps peak memory at the weights
    # themselves (no f32 staging).
    @functools.cache
    def program(shape, dtype, sharding, stacked):
        def values(k, layer):
            if stacked:
                return jnp.stack([uniform(jax.random.fold_in(k, i), shape[1:], dtype)
                                  for i in range(shape[0])])
            return uniform(jax.random.fold_in(k, layer), shape, dtype)

        return jax.jit(values, out_shardings=sharding)

    # Keyed by the leaf's name and layer, not its place in the tree.
    def make(path, leaf, sharding):
        names = [str(getattr(k, "key", "")) for k in path]
        key = jax.random.fold_in(root, zlib.crc32("/".join(n for n in names if n).encode()))
        layer = getattr(path[1], "idx", None) if len(path) > 1 else None
        stacked = names[0] == "layers" and layer is None
        if layer is None and not stacked:  # a leaf outside the layers: its own key
            made = jax.jit(lambda k: uniform(k, leaf.shape, leaf.dtype),
                           out_shardings=sharding)(key)
        else:
            made = program(leaf.shape, leaf.dtype, sharding, stacked)(key, layer or 0)
        return made if transform is None else transform(path, made)

    return jax.tree_util.tree_map_with_path(make, shapes, placements)

