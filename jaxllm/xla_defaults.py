"""XLA settings jaxllm wants before JAX starts its GPU backend (set on import of ``jaxllm``).

Why: XLA runs a step's kernels as CUDA graphs (command buffers), but leaves Pallas' Triton
calls (``__gpu$xla.gpu.triton``) out unless they are listed in
``--legacy_command_buffer_custom_call_targets`` (jax-ml/jax#27988). Each of the 32 attention
calls of an unrolled 8B step then splits the graph, and the step's launch held the H200's
host 2.2 ms against 0.9 ms for the same program on XLA's attention (RESULTS.md, "what an 8B
step's launch costs"); the engine's small steps are bound by that launch.

Applied only where JAX's CUDA plugin is installed (the flag is unknown to the CPU-only
jaxlib, which refuses unknown ``XLA_FLAGS``). A setting already in ``XLA_FLAGS`` is the user's
and is left alone; ``JAXLLM_XLA_DEFAULTS=0`` adds nothing; with the backend already started
(JAX used before importing jaxllm) nothing here takes effect.
"""

from __future__ import annotations

import importlib.util
import os

PALLAS_TRITON_TARGET = "__gpu$xla.gpu.triton"
DEFAULT_FLAGS = {"legacy_command_buffer_custom_call_targets": PALLAS_TRITON_TARGET}


def with_defaults(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with jaxllm's defaults added where it names none."""
    added = [f"--{name}={value}" for name, value in DEFAULT_FLAGS.items() if name not in flags]
    return " ".join([flags.strip(), *added]).strip()


def _has_cuda_plugin() -> bool:
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None
                   for v in (13, 12))
    except ImportError:  # no jax_plugins namespace: a CPU-only install
        return False


def apply(environ=os.environ, has_cuda=_has_cuda_plugin) -> None:
    if environ.get("JAXLLM_XLA_DEFAULTS", "1") == "0" or not has_cuda():
        return
    environ["XLA_FLAGS"] = with_defaults(environ.get("XLA_FLAGS", ""))
