"""The executable cache: compiled step programs kept on disk, keyed without tracing, so that a
restarted engine neither traces, lowers nor compiles them (issue 16's warm restart).

JAX's persistent compilation cache (``compile_cache.py``) keys an entry by the lowered HLO:
a warm start still traces and lowers every bucket's program (the unrolled 32-layer forward,
~75 programs for the Llama-3-8B shape), which holds the GIL, before it finds the compiled
program. This cache sits in front of it: an entry is the serialized executable
(``jax.experimental.serialize_executable``) under a key computed from what determines the
program without running the Python that builds it:

- the program's name, and the runner's context (model config, activation dtype, attention
  backend, mesh, row bucket, quantization, layer layout: ``ProgramKey`` and friends),
- its arguments' pytree structure, shapes, dtypes and shardings (with the device ids: a
  program is compiled for its devices) and its static arguments (the bucket's shape, the
  sampler variant),
- the process's environment (:func:`environment`): jax and jaxlib versions, backend, platform
  version and devices, ``XLA_FLAGS`` and the other :data:`PROGRAM_ENV` variables, JAX's
  configuration, and a hash of the jaxllm and pallas_kernels sources, so any code change
  misses.

Entries live in ``<compilation_cache_dir>/executables`` and are written as JAX's cache entries
are in this engine (:class:`~jaxllm.engine.compile_cache.AtomicLRUCache`: a whole file renamed
into place), so processes sharing the directory read none or a whole one. An entry carries a
checksum; one that is corrupt or does not load (another jaxlib, a missing device) is
compiled again with a warning and replaced: never a failed start.

Like JAX's own cache, an entry is a pickle: the directory must be trusted as much as the
code (``deserialize_and_load`` says so).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import logging
import os
import pickle
import threading
from typing import Any

import jax
from jax._src import compilation_cache as _jax_cc
from jax.experimental import serialize_executable

from jaxllm.engine.compile_cache import AtomicLRUCache, _remove_stale_temporaries

logger = logging.getLogger(__name__)

FORMAT = b"jaxllm-executable-v1\n"  # bumped when the entry's layout changes
SUBDIR = "executables"
# JAX settings that do not change a compiled program (where caches and logs go).
_IGNORED_CONFIG = ("cache", "log", "dump", "traceback", "pprint", "mtls", "timeout")
# Environment variables that change compiled programs (JAX's own are in its configuration).
# A jaxllm variable read while building or compiling a step program must be listed here; the
# others (JAXLLM_COMMIT, JAXLLM_API_KEY ...) would only make restarts miss.
PROGRAM_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAXLLM_FP8_AUTOTUNE_LEVEL",
               "JAXLLM_FP8_SWIGLU_KERNEL", "JAXLLM_FP8_NORM_KERNEL", "JAXLLM_STAGE_STEP_INPUT",
               "JAXLLM_INT4_HOPPER", "JAXLLM_INT4_FUSION",
               "JAXLLM_ROPE_KV_KERNEL")


def compile_lowered(lowered, compiler_options: dict | None = None):
    """``lowered`` compiled, with XLA options for this executable alone when given."""
    return lowered.compile(compiler_options=compiler_options) if compiler_options \
        else lowered.compile()


class ExecutableCache:
    """Compiled programs by key, on disk; counts what it loaded and what it compiled."""

    def __init__(self, directory: str):
        self.directory = directory
        self._files = AtomicLRUCache(directory, max_size=-1)
        self._lock = threading.Lock()
        # Leaf signatures by (shape, dtype, weak type, sharding): an 8B model's ~300
        # parameters share a few, and a warm start computes ~150 keys.
        self._where: dict[Any, str] = {}
        self.num_loaded = 0  # executables read from the cache (no tracing, no lowering)
        self.num_compiled = 0  # executables traced, lowered and compiled (then stored)

    @classmethod
    def open(cls, compilation_cache_dir: str) -> ExecutableCache | None:
        """The cache under ``compilation_cache_dir``, or None (with a warning) where it cannot
        be used: an unwritable directory, several processes (multi-host programs span
        devices this process cannot load alone), or a JAX without the names relied on."""
        if jax.process_count() > 1:
            logger.info("executable cache off: %d processes", jax.process_count())
            return None
        missing = [f"{m.__name__}.{n}" for m, names in JAX_NAMES_USED.items()
                   for n in names if not hasattr(m, n)]
        if missing:
            logger.warning("executable cache off: JAX %s has no %s", jax.__version__,
                           ", ".join(missing))
            return None
        _install_read_capture()
        directory = os.path.join(compilation_cache_dir, SUBDIR)
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, f".tmp-probe-{os.getpid()}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as e:
            logger.warning("executable cache directory %r cannot be used (%s): every start "
                           "traces and lowers its programs", directory, e)
            return None
        _remove_stale_temporaries(directory)
        return cls(directory)

    def key(self, name: str, args: tuple, static: dict, context: Any) -> str:
        """The entry's key: a hash of everything that determines the program (module doc)."""
        leaves, tree = jax.tree.flatten(args)
        parts = [FORMAT.decode(), environment(), name, repr(context),
                 repr(sorted(static.items())), str(tree)]
        parts += [_leaf_signature(leaf, self._where) for leaf in leaves]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def contains(self, key: str) -> bool:
        return os.path.exists(os.path.join(self.directory, f"{key}-cache"))

    def get_or_compile(self, name: str, jitted, args: tuple, static: dict, context: Any,
                       compiler_options: dict | None = None):
        """``jitted.lower(*args, **static).compile(compiler_options)``, read from the cache
        when an entry for the same program is there; else compiled and stored. The options
        must be part of ``context``: the key does not see them."""
        key = self.key(name, args, static, context)
        exe = self._load(key, name)
        if exe is not None:
            with self._lock:
                self.num_loaded += 1
            return exe
        exe = compile_lowered(jitted.lower(*args, **static), compiler_options)
        with self._lock:
            self.num_compiled += 1
        self._store(key, name, exe)
        return exe

    def _load(self, key: str, name: str):
        try:
            value = self._files.get(key)
        except OSError as e:
            logger.warning("executable cache: cannot read %s's entry (%s): compiling", name, e)
            return None
        if value is None:
            return None
        try:
            return _deserialize(value)
        except Exception as e:  # noqa: BLE001 - any failure to load means: compile instead
            logger.warning("executable cache: %s's entry %s does not load (%s: %s): compiling "
                           "it again", name, key[:16], type(e).__name__, e)
            return None

    def _store(self, key: str, name: str, exe) -> None:
        try:
            value = _serialize(exe)
        except Exception as e:  # noqa: BLE001 - a program that does not serialize still runs
            logger.warning("executable cache: %s does not serialize (%s: %s)", name,
                           type(e).__name__, e)
            return
        try:
            self._files.put(key, value)
        except OSError as e:  # a full disk: the next start compiles it again
            logger.warning("executable cache: cannot write %s's entry (%s)", name, e)


# --- Executables that JAX's persistent cache gave. ---------------------------------------------
# An executable read from JAX's cache does not serialize whole again: on CPU (jaxlib 0.11.2) the
# bytes lack its functions' code, and a process that loads them fails at the first call
# ("Function wrapped_iota not found"; tests/test_executable_cache.py starts engines through
# that path). Such an entry is written from the bytes JAX's cache read instead, captured here
# per thread (the warm-up compiles in several). The private names used, checked by the tests:
JAX_NAMES_USED = {
    _jax_cc: ("get_executable_and_time", "extract_executable_and_time"),
    serialize_executable: ("_JaxPjrtPickler",),
}
_read = threading.local()  # .serialized: the bytes JAX's cache last read in this thread


def _install_read_capture() -> None:
    if getattr(_jax_cc.get_executable_and_time, "jaxllm_capture", False):
        return
    jax_get, jax_extract = _jax_cc.get_executable_and_time, _jax_cc.extract_executable_and_time

    def extract_executable_and_time(executable_and_time):
        serialized, compile_time = jax_extract(executable_and_time)
        _read.serialized = serialized
        return serialized, compile_time

    def get_executable_and_time(*args, **kwargs):
        _read.serialized = None
        executable, compile_time = jax_get(*args, **kwargs)
        _read.executable = executable  # whose bytes _read.serialized are
        return executable, compile_time

    get_executable_and_time.jaxllm_capture = True
    # Both looked up by name in the module when JAX's compile path calls them.
    _jax_cc.extract_executable_and_time = extract_executable_and_time
    _jax_cc.get_executable_and_time = get_executable_and_time


class _Pickler(getattr(serialize_executable, "_JaxPjrtPickler", pickle.Pickler)):
    """serialize_executable's pickler, writing ``raw`` for the executable ``loaded``."""

    def __init__(self, file, loaded, raw: bytes | None):
        super().__init__(file)
        self._loaded, self._raw = loaded, raw

    def persistent_id(self, obj):
        if self._raw is not None and obj is self._loaded:
            return ("exec", self._raw)
        return super().persistent_id(obj)


def _serialize(exe) -> bytes:
    """``serialize_executable.serialize``, with JAX's cache's bytes for an executable it read."""
    unloaded = getattr(exe._executable, "_unloaded_executable", None)
    if unloaded is None or exe._params.const_args:
        raise ValueError("this program does not serialize")
    loaded = exe._executable.xla_executable
    raw = getattr(_read, "serialized", None) if getattr(_read, "executable", None) is loaded \
        else None
    _read.executable = _read.serialized = None
    args_info, in_tree = jax.tree_util.tree_flatten(exe.args_info)
    with io.BytesIO() as f:
        _Pickler(f, loaded, raw).dump((unloaded, args_info, exe._no_kwargs))
        payload = f.getvalue()
    # The devices it runs on, in the order of its device assignment: loading it onto any
    # others fails, or aborts the process (a check in XLA), so they are named, not assumed.
    devices = [d.id for d in loaded.local_devices()]
    body = pickle.dumps((payload, in_tree, exe.out_tree, devices),
                        protocol=pickle.HIGHEST_PROTOCOL)
    return FORMAT + hashlib.sha256(body).digest() + body


def _deserialize(value: bytes):
    if not value.startswith(FORMAT):
        raise ValueError("not an entry of this format")
    digest, body = value[len(FORMAT):len(FORMAT) + 32], value[len(FORMAT) + 32:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch (a truncated or damaged file)")
    payload, in_tree, out_tree, device_ids = pickle.loads(body)
    by_id = {d.id: d for d in jax.devices()}
    missing = [i for i in device_ids if i not in by_id]
    if missing:
        raise ValueError(f"devices {missing} are not in this process")
    return serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])


def _leaf_signature(leaf, known: dict[Any, str]) -> str:
    """A leaf's shape, dtype, weak type and placement (sharding and device ids), as text;
    memoized in ``known`` (formatting a dtype costs more than the lookup)."""
    sharding = getattr(leaf, "sharding", None)
    memo = (getattr(leaf, "shape", ()), getattr(leaf, "dtype", type(leaf)),
            getattr(leaf, "weak_type", False), sharding)
    text = known.get(memo)
    if text is None:
        where = "host"  # numpy and Python values: placed where the program's devices are
        if sharding is not None:
            devices = getattr(sharding, "_device_assignment", None) or sorted(
                sharding.device_set, key=lambda d: d.id)
            where = f"{sharding!r}@{[d.id for d in devices]}"
        text = known[memo] = f"{memo[0]}:{memo[1]}:{memo[2]}:{where}"
    return text


@functools.cache
def environment() -> str:
    """What of this process shapes every program (module doc); computed once."""
    import jaxlib

    devices = jax.devices()
    config = {k: v for k, v in sorted(jax.config.values.items())
              if not any(word in k for word in _IGNORED_CONFIG)}
    env = {k: os.environ.get(k) for k in PROGRAM_ENV}
    return "\n".join([
        f"jax {jax.__version__} jaxlib {jaxlib.__version__}",
        f"{jax.default_backend()} {devices[0].client.platform_version}",
        repr([(d.id, d.device_kind) for d in devices]),
        repr(env), repr(config), source_hash()])


@functools.cache
def source_hash() -> str:
    """sha256 over the jaxllm and pallas_kernels sources."""
    roots = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # jaxllm/
    spec = importlib.util.find_spec("jaxllm.pallas_kernels")
    if spec is not None and spec.submodule_search_locations:
        roots += list(spec.submodule_search_locations)
    return hash_sources(roots)


def hash_sources(roots: list[str]) -> str:
    """sha256 over every .py file under ``roots``, each with its path relative to its root's
    parent (a renamed or moved file changes it too)."""
    digest = hashlib.sha256()
    for root in sorted(set(roots)):
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, os.path.dirname(root)).encode())
                    with open(path, "rb") as f:
                        digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()
