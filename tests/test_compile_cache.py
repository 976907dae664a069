"""The persistent compilation cache written by several processes at once: entries are renamed
into place whole (jaxllm.engine.compile_cache.AtomicLRUCache), where JAX 0.11.2's own put
writes them under their final name, so a reader in another process can read half of one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from jax._src import compilation_cache as jax_cc
from jax._src.lru_cache import LRUCache

from jaxllm.engine import compile_cache
from jaxllm.engine.compile_cache import AtomicLRUCache, install_atomic_cache_writes

MODULE = compile_cache.__file__
# Loads compile_cache.py by its path: a subprocess then imports JAX only, not all of jaxllm
# (seconds less on two cores). Its import installs the atomic writes, as `import jaxllm` does.
LOAD_MODULE = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("compile_cache", {MODULE!r})
compile_cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compile_cache)
"""

# Writers put self-checking values (a header with the body's length and CRC) of 4 MB under the
# same keys, one after the other; readers poll each key until they read a whole value, counting
# every value read that fails its check. Each is its own process, forked by one that imported
# JAX (and initialized no backend, so no threads): one JAX import instead of one each. They
# start together, twice: over JAX's LRUCache, then over AtomicLRUCache, in their own directories.
RACE = LOAD_MODULE + """
import hashlib, json, multiprocessing, os, struct, sys, time, zlib
from jax._src.lru_cache import LRUCache

HEADER = struct.Struct("<4sQI")


def payload(me, n):
    body = hashlib.sha256(f"{me}-{n}".encode()).digest() * (4 * 2**20 // 32)
    return HEADER.pack(b"JXLC", len(body), zlib.crc32(body)) + body


def whole(value):
    if len(value) < HEADER.size:
        return False
    magic, size, crc = HEADER.unpack_from(value)
    body = memoryview(value)[HEADER.size:]
    return magic == b"JXLC" and len(body) == size and zlib.crc32(body) == crc


def run(role, me, nkeys, root, barrier, results):
    result = {}
    for name, cls in (("jax", LRUCache), ("atomic", compile_cache.AtomicLRUCache)):
        cache = cls(os.path.join(root, name), max_size=-1)
        barrier.wait()
        torn = whole_reads = 0
        for n in range(nkeys):
            if role == "writer":
                cache.put(f"k{n}", payload(me, n))
                time.sleep(0.01)  # the readers move on to the next key
                continue
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                value = cache.get(f"k{n}")
                if value is not None:
                    if whole(value):
                        whole_reads += 1
                        break
                    torn += 1
        result[name] = {"torn": torn, "whole": whole_reads}
    results.put((me, role, result))


if __name__ == "__main__":
    writers, readers, nkeys = map(int, sys.argv[1:4])
    root = sys.argv[4]
    roles = ["writer"] * writers + ["reader"] * readers
    fork = multiprocessing.get_context("fork")
    barrier, results = fork.Barrier(len(roles)), fork.Queue()
    procs = [fork.Process(target=run, args=(role, me, nkeys, root, barrier, results))
             for me, role in enumerate(roles)]
    for p in procs:
        p.start()
    out = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
        assert p.exitcode == 0, p.exitcode
    print(json.dumps(sorted(out)))
"""


def test_concurrent_writers_and_readers_never_see_part_of_an_entry(tmp_path):
    nkeys = 8
    race = subprocess.run([sys.executable, "-c", RACE, "2", "2", str(nkeys), str(tmp_path)],
                          capture_output=True, text=True, timeout=180)
    assert race.returncode == 0, race.stderr
    read = [r for _, role, r in json.loads(race.stdout.strip().splitlines()[-1])
            if role == "reader"]
    assert len(read) == 2
    # Every reader read every key whole, and never part of one.
    assert all(r["atomic"] == {"torn": 0, "whole": nkeys} for r in read), read
    assert not [f for f in os.listdir(tmp_path / "atomic") if f.startswith(".tmp-")]
    # The same readers caught JAX's own put mid-write: the check can fail. If this stops
    # happening, JAX may write atomically now and AtomicLRUCache can go.
    assert sum(r["jax"]["torn"] for r in read) > 0, read
    assert all(r["jax"]["whole"] == nkeys for r in read), read


def base(cache):
    """The file cache under JAX's VerificationCache, if any."""
    return cache._base_cache if isinstance(cache, jax_cc.VerificationCache) else cache


def test_put_renames_a_complete_file_onto_a_free_name(tmp_path, monkeypatch):
    cache = AtomicLRUCache(str(tmp_path), max_size=-1)
    value = os.urandom(1 << 20)
    real_replace = os.replace
    renames = []

    def replace(src, dst):
        assert os.path.basename(src).startswith(".tmp-")
        assert os.path.getsize(src) == len(value if not renames else b"another value")
        assert os.path.exists(dst) == bool(renames)
        renames.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    cache.put("key", value)
    assert cache.get("key") == value
    # A put of an existing key (JAX puts only after a failed read) replaces it, whole.
    value = b"another value"
    cache.put("key", value)
    assert renames == [str(tmp_path / "key-cache")] * 2
    assert cache.get("key") == value
    assert sorted(os.listdir(tmp_path)) == ["key-cache"]
    umask = os.umask(0)
    os.umask(umask)
    # The mode JAX's own files get, not mkstemp's 0o600: other users sharing the directory.
    assert os.stat(tmp_path / "key-cache").st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_put_leaves_no_entry_and_no_temporary_file(tmp_path, monkeypatch):
    cache = AtomicLRUCache(str(tmp_path), max_size=-1)

    def replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        cache.put("key", b"x" * 1000)
    assert os.listdir(tmp_path) == []
    assert cache.get("key") is None


def test_with_a_size_limit_puts_go_through_jax_under_its_lock(tmp_path):
    cache = AtomicLRUCache(str(tmp_path), max_size=2500)
    for key in ("a", "b", "c"):
        cache.put(key, key.encode() * 1000)
        cache.get(key)
    assert cache.get("a") is None  # evicted as JAX does, least recently used first
    assert cache.get("c") == b"c" * 1000
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_install_is_idempotent_and_upgrades_a_cache_jax_already_built(tmp_path, monkeypatch):
    # The private JAX names relied on: if JAX renames them this fails (and the engine warns
    # and falls back to JAX's own, non-atomic, writes).
    for module, names in compile_cache.JAX_NAMES_USED.items():
        for name in names:
            assert hasattr(module, name), f"{module.__name__}.{name} is gone"
    plain = LRUCache(str(tmp_path / "plain"), max_size=-1)
    for attr in ("path", "eviction_enabled", "_is_local"):
        assert hasattr(plain, attr), f"LRUCache().{attr} is gone"
    verifying = jax_cc.VerificationCache(LRUCache(str(tmp_path / "verified"), max_size=-1))
    assert hasattr(verifying, "_base_cache")

    get_file_cache = jax_cc.get_file_cache
    assert get_file_cache.jaxllm_atomic  # installed when jaxllm was imported
    for cache in (plain, verifying):
        monkeypatch.setattr(jax_cc, "_cache", cache)
        assert install_atomic_cache_writes() and install_atomic_cache_writes()
        assert jax_cc.get_file_cache is get_file_cache  # not wrapped twice
    assert type(plain) is AtomicLRUCache
    assert type(verifying._base_cache) is AtomicLRUCache
    assert type(base(jax_cc.get_file_cache(str(tmp_path / "new"))[0])) is AtomicLRUCache


def test_the_cache_this_test_run_uses_is_atomic():
    # conftest sets JAX_COMPILATION_CACHE_DIR; jaxllm is imported: JAX's cache, built on the
    # first compile of this process, writes atomically.
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(4.0)).block_until_ready()
    assert jax_cc._cache is not None
    assert type(base(jax_cc._cache)) is AtomicLRUCache


# A process that built JAX's cache before loading jaxllm's module (upgraded in place), then
# calls use_compilation_cache and compiles a second function; a second process compiles both
# from the directory alone and must load them from it.
FUNCTIONS = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
x = np.arange(8.0, dtype=np.float32)
f, g = jax.jit(lambda x: jnp.sin(x) * 2), jax.jit(lambda x: jnp.cos(x) + 1)
"""
WRITER = FUNCTIONS + """
from jax._src import compilation_cache as jax_cc
from jax._src.lru_cache import LRUCache
f(x).block_until_ready()
assert type(jax_cc._cache) is LRUCache, jax_cc._cache
""" + LOAD_MODULE + """
assert type(jax_cc._cache) is compile_cache.AtomicLRUCache, jax_cc._cache
puts = []
atomic_put = compile_cache.AtomicLRUCache.put
compile_cache.AtomicLRUCache.put = lambda self, k, v: (puts.append(k), atomic_put(self, k, v))
assert compile_cache.use_compilation_cache(sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
g(x).block_until_ready()
print(json.dumps({"puts": len(puts), "files": sorted(os.listdir(sys.argv[1]))}))
"""
READER = FUNCTIONS + """
events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
assert np.allclose(f(x), np.sin(x) * 2) and np.allclose(g(x), np.cos(x) + 1)
print(events.count("/jax/compilation_cache/cache_hits"))
"""


def test_entries_written_by_one_process_load_whole_in_another(tmp_path):
    directory = str(tmp_path / "xla")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=directory,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
    writer = subprocess.run([sys.executable, "-c", WRITER, directory],
                            env=env, capture_output=True, text=True, timeout=120)
    assert writer.returncode == 0, writer.stderr
    written = json.loads(writer.stdout.strip().splitlines()[-1])
    assert written["puts"] == 1  # the second function went through the atomic put
    entries = [f for f in written["files"] if f.endswith("-cache")]
    assert len(entries) == 2 and not [f for f in written["files"] if f.startswith(".tmp-")]

    reader = subprocess.run([sys.executable, "-c", READER], env=env, capture_output=True,
                            text=True, timeout=120)
    assert reader.returncode == 0, reader.stderr
    assert "Error reading persistent compilation cache" not in reader.stderr
    assert reader.stdout.strip().splitlines()[-1] == "2", reader.stderr


def test_a_corrupt_entry_is_compiled_again_and_replaced(tmp_path):
    """An entry that does not read (a disk error, a copy cut short): JAX warns and compiles,
    and the put that follows replaces the entry, so the next process reads it whole."""
    directory = str(tmp_path / "xla")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=directory,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
    # READER computes, checks and writes f and g; jaxllm's cache is installed on import.
    reader = [sys.executable, "-c", LOAD_MODULE + READER]
    runs = []
    for corrupt in (False, True, False):
        if corrupt:
            for name in os.listdir(directory):
                with open(os.path.join(directory, name), "r+b") as f:
                    f.truncate(os.path.getsize(f.name) // 2)
        run = subprocess.run(reader, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        runs.append((run.stdout.strip().splitlines()[-1],
                     "Error reading persistent compilation cache" in run.stderr))
    assert runs == [("0", False), ("0", True), ("2", False)], runs


def test_temporaries_of_writers_that_died_are_removed(tmp_path):
    stale, fresh = tmp_path / ".tmp-1-dead", tmp_path / ".tmp-2-writing"
    for path in (stale, fresh):
        path.write_bytes(b"part of an entry")
    old = time.time() - compile_cache.STALE_TEMP_SECONDS - 60
    os.utime(stale, (old, old))
    jax_cc.get_file_cache(str(tmp_path))  # as JAX builds its cache on the first compile
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh.name]
