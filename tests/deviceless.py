"""Tests that compile for a GPU on a machine without one (XLA's deviceless compile)."""

import importlib.util

import pytest

needs_cuda_plugin = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins") is None
    or not any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13)),
    reason="deviceless GPU compilation needs JAX's CUDA plugin")
