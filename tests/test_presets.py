"""The named shapes used by benchmarks are the published models' shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxllm.models import param_shapes
from jaxllm.presets import PRESETS

# Parameter counts of the published checkpoints (embedding and LM head included).
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_248_023_552,
    "qwen2-7b": 7_615_616_512,
    "smollm2-135m": 134_515_008,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_has_the_published_parameter_count(name):
    shapes = param_shapes(PRESETS[name], jnp.bfloat16)  # abstract: nothing is allocated
    assert sum(leaf.size for leaf in jax.tree.leaves(shapes)) == PUBLISHED[name]
