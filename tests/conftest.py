"""Shared fixtures: the real SmolLM2 model (loaded once) and tiny random model helpers."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

# Parity tests compare float32 numerics with torch; keep XLA's CPU matmuls exact.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def smollm2():
    import jaxllm

    return jaxllm.load_model(None, dtype="float32")
