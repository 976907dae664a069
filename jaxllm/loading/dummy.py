"""``load_format="dummy"``: random weights of a config's real shape, made on the device.

As in vLLM, every value is uniform in [-1e-3, 1e-3]: good for timing, meaningless as text.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxllm.model_config import ModelConfig
from jaxllm.models.llama import param_shapes

DUMMY_RANGE = 1e-3


def dummy_params(config: ModelConfig, dtype: Any, seed: int = 0) -> Any:
    shapes = param_shapes(config, dtype)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    # One jitted call per leaf keeps peak memory at the weights themselves (no f32 staging).
    def make(key, leaf):
        return jax.jit(lambda k: jax.random.uniform(
            k, leaf.shape, leaf.dtype, -DUMMY_RANGE, DUMMY_RANGE))(key)

    made = [make(key, leaf) for key, leaf in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(treedef, made)
