"""The persistent compilation cache (``EngineConfig.compilation_cache_dir``): XLA programs kept
on disk so that a restarted engine skips their compile.

A cache directory that cannot be used (unwritable, a path through a file, a full disk) is
worth a warning, not a failed start: the engine then compiles as it would without one. Corrupt
entries are JAX's to handle (it warns and compiles again).
"""

from __future__ import annotations

import logging
import os
import tempfile

import jax

logger = logging.getLogger(__name__)
MIN_COMPILE_SECONDS = 0.5  # programs quicker to compile than this are not worth a file


def use_compilation_cache(path: str) -> bool:
    """Points JAX's persistent cache at ``path`` if it can be written there; else warns and
    leaves the cache off. Returns whether it is on."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        logger.warning("compilation cache directory %r cannot be used (%s): compiling without "
                       "a persistent cache", path, e)
        return False
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return True
