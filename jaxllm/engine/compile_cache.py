"""The persistent compilation cache (``EngineConfig.compilation_cache_dir``): XLA programs kept
on disk so that a restarted engine skips their compile.

A cache directory that cannot be used (unwritable, a path through a file, a full disk) is
worth a warning, not a failed start: the engine then compiles as it would without one. An
entry that does not read (corrupt) makes JAX warn and compile again; the put that follows
replaces it (:class:`AtomicLRUCache`).

Several processes may share one directory (replicas on a host, pods on a shared volume), so
its entries are written atomically: see :class:`AtomicLRUCache`, installed when this module is
imported (``import jaxllm`` does), whichever way the directory was set
(``use_compilation_cache``, ``JAX_COMPILATION_CACHE_DIR``, ``jax.config``).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid

import jax
from jax._src import compilation_cache as _jax_cc
from jax._src import lru_cache as _jax_lru

logger = logging.getLogger(__name__)
# Every program is written, however quick to compile: a warm start otherwise compiles again the
# small ones around the step programs (weight init and casts, pool zeros, block copies), ~20-30
# of them: a tiny Llama on CPU was ready in 3.0-3.8 s with a 0.5 s threshold, 1.3-1.5 s without.
MIN_COMPILE_SECONDS = 0.0


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
    install_atomic_cache_writes()
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return True


# --- Atomic cache writes. ---------------------------------------------------------------------
# JAX 0.11.2's file cache (jax._src.lru_cache.LRUCache.put) writes an entry straight under its
# final name (`cache_path.write_bytes(value)`) and, without a size limit
# (jax_compilation_cache_max_size -1, the default), takes no lock: another process's `get`
# can read a half-written file ("Error reading persistent compilation cache entry ...
# incomplete or truncated stream", then a recompile; seen with two engines started at once on
# an H200). The subclass below writes a temporary file and renames it into place. Drop it (and
# the private JAX names used here, checked by tests/test_compile_cache.py) once JAX writes its
# entries atomically.

JAX_NAMES_USED = {  # module: the private names relied on
    _jax_cc: ("get_file_cache", "_cache", "VerificationCache", "LRUCache"),
    _jax_lru: ("LRUCache", "_CACHE_SUFFIX"),
}


class AtomicLRUCache(_jax_lru.LRUCache):
    """JAX's LRUCache whose ``put`` renames a complete temporary file onto the entry's name, so
    that a reader in another process finds no entry or a whole one, never part of one."""

    def put(self, key: str, value: bytes) -> None:
        if self.eviction_enabled or not self._is_local:
            # With a size limit JAX holds a file lock around both put and get (and keeps the
            # access times eviction needs); a remote path (etils epath) has no os.replace.
            return super().put(key, value)
        if not key:
            raise ValueError("key cannot be empty")
        path = os.path.join(str(self.path), f"{key}{_jax_lru._CACHE_SUFFIX}")
        # Unlike JAX's put, an existing entry is replaced: JAX puts a key only after its read
        # missed or failed, so an entry here is one that did not read (corrupt: JAX would keep
        # it, warning and recompiling in every process from then on) or one another process
        # wrote meanwhile (replaced by an equal, whole value).
        # A name no other writer picks, outside the "*-cache" glob eviction counts; mode 0o666
        # less the umask, as JAX's write_bytes gives (mkstemp's 0o600 would hide the entry
        # from other users sharing the directory).
        tmp = os.path.join(str(self.path), f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


STALE_TEMP_SECONDS = 3600  # a temporary entry this old belongs to a writer that died


def _atomic(cache):
    """``cache`` with its plain LRUCache (or a VerificationCache's) made atomic in place: the
    subclass adds only a method, so the instance keeps its path, size limit and lock. The
    temporary files of writers killed mid-put (older than STALE_TEMP_SECONDS) are removed."""
    target = cache
    if isinstance(cache, _jax_cc.VerificationCache):
        target = cache._base_cache
    if type(target) is _jax_lru.LRUCache:
        target.__class__ = AtomicLRUCache
    if isinstance(target, AtomicLRUCache) and target._is_local:
        _remove_stale_temporaries(str(target.path))
    return cache


def _remove_stale_temporaries(directory: str) -> None:
    cutoff = time.time() - STALE_TEMP_SECONDS
    for entry in os.scandir(directory):
        try:
            if entry.name.startswith(".tmp-") and entry.stat().st_mtime < cutoff:
                os.unlink(entry.path)
        except OSError:  # another process removed or renamed it first
            pass


def install_atomic_cache_writes() -> bool:
    """Makes JAX's persistent cache write atomically in this process: the cache JAX builds on
    its first compile, and the one it already built if it did. Idempotent; returns whether it
    is installed (False, with a warning, if JAX no longer has the names relied on)."""
    missing = [f"{m.__name__}.{n}" for m, names in JAX_NAMES_USED.items()
               for n in names if not hasattr(m, n)]
    if missing:
        logger.warning("cannot make compilation cache writes atomic: JAX %s has no %s",
                       jax.__version__, ", ".join(missing))
        return False
    if not getattr(_jax_cc.get_file_cache, "jaxllm_atomic", False):
        jax_get_file_cache = _jax_cc.get_file_cache

        def get_file_cache(path):
            made = jax_get_file_cache(path)
            return None if made is None else (_atomic(made[0]), made[1])

        get_file_cache.jaxllm_atomic = True
        _jax_cc.get_file_cache = get_file_cache  # looked up by _initialize_cache when called
    if _jax_cc._cache is not None:
        _atomic(_jax_cc._cache)
    return True


install_atomic_cache_writes()
