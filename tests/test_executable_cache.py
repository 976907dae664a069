"""The executable cache (jaxllm.engine.executable_cache): a restarted engine reads its compiled
step programs from disk without tracing or lowering them; anything that shapes a program
changes its key; an entry that does not load is compiled again, with a warning."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine import executable_cache
from jaxllm.engine.executable_cache import ExecutableCache, hash_sources

TESTS = os.path.dirname(__file__)

# One engine start over a tiny random model (the same in every process: seeded), then two greedy
# requests. Counts the traces of the step programs' functions (JAX's own tracing event, so the
# count does not rely on the cache's bookkeeping) and prints what the cache did.
START = """
import json, sys
import jax, jax.numpy as jnp
from jax._src import dispatch

traced, jax_cache = [], []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, fun_name="", **kw: traced.append(fun_name)
    if event == dispatch.JAXPR_TRACE_EVENT else None)
jax.monitoring.register_event_listener(  # every program compiled through JAX's cache
    lambda event, **kw: jax_cache.append(event.rsplit("/", 1)[-1])
    if event.startswith("/jax/compilation_cache/") else None)
import numpy as np
sys.path.insert(0, sys.argv[2])
from tiny_models import TINY_CONFIGS
from jaxllm import EngineConfig, LLMEngine, SamplingParams
from jaxllm.engine import executable_cache
from jaxllm.loading import LoadedModel
from jaxllm.models.llama import param_shapes

# The starts run one source: the hash is pinned so that an edit to the checkout while the test
# runs does not make them miss (test_the_source_hash_changes_with_any_source_file covers it).
executable_cache.source_hash = lambda: "the source under test"

cfg = TINY_CONFIGS["qwen2_bias"]
# Seeded numpy values (tiny_models.random_params runs flax's init op by op: ~10 s a process).
rng = np.random.default_rng(21)
params = jax.device_put(jax.tree_util.tree_map_with_path(
    lambda path, x: (("scale" in jax.tree_util.keystr(path))
                     + 0.3 * rng.standard_normal(x.shape)).astype(x.dtype),
    param_shapes(cfg, jnp.float32)))
model = LoadedModel("tiny", cfg, params, None, jnp.float32)
# One sequence at a time: the fewest programs (2 forwards, 3 sampler variants).
engine = LLMEngine(EngineConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=32,
                                block_size=8, num_gpu_blocks_override=16,
                                compilation_cache_dir=sys.argv[1]), model=model, progress=False)
greedy = SamplingParams(temperature=0, max_tokens=6)
engine.add_request("a", prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], params=greedy)
engine.add_request("b", prompt_token_ids=[7, 8, 9], params=greedy)
tokens = {}
while engine.has_unfinished_requests():
    tokens |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
cache = engine.runner.executable_cache
print(json.dumps({"tokens": tokens, "loaded": cache.num_loaded, "compiled": cache.num_compiled,
                  "traced": [n for n in traced if n in ("forward_after", "sample_padded")],
                  "jax_cache": {e: jax_cache.count(e) for e in ("compile_requests_use_cache",
                                                                "cache_hits")},
                  "report": engine.runner.warm_up_report}))
"""


def start(directory) -> subprocess.Popen:
    # Compiled as the suite's other tiny models are (conftest): XLA's CPU optimizations off.
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    return subprocess.Popen([sys.executable, "-c", START, str(directory), TESTS], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]) | {
        "warnings": [line for line in err.splitlines() if "executable cache" in line]}


def test_a_restarted_engine_loads_every_program_and_samples_the_same_tokens(tmp_path):
    # Two cold starts at once over one directory: each writes the entries it compiles (the one
    # that falls behind may read some the other wrote first, or compile them through JAX's
    # cache); neither ever reads part of one (no warning).
    cold = [result(p) for p in [start(tmp_path), start(tmp_path)]]
    programs = cold[0]["report"]["programs"]
    assert programs >= 5  # forwards per bucket + sampler variants
    for run in cold:
        assert run["compiled"] + run["loaded"] == programs, run
        assert len(run["traced"]) == run["compiled"]
    assert sum(run["compiled"] for run in cold) >= programs  # each entry written by a compile
    entries = os.listdir(tmp_path / "executables")
    assert len(entries) == programs  # one per program, no temporary file left behind
    # A third start reads what they left: nothing traced, lowered or compiled; same tokens.
    warm = result(start(tmp_path))
    assert warm["loaded"] == programs and warm["compiled"] == 0 and warm["traced"] == [], warm
    # Nor any of the small programs around them (pool zeros, block copies, casts): each quick
    # to compile, together seconds of a warm start; all read from JAX's cache.
    requests, hits = warm["jax_cache"].values()
    assert requests > 0 and hits == requests, warm["jax_cache"]
    assert warm["report"]["cached"] == programs
    assert warm["tokens"] == cold[0]["tokens"] == cold[1]["tokens"]
    assert [len(t) for t in warm["tokens"].values()] == [6, 6]
    assert len({t for tokens in warm["tokens"].values() for t in tokens}) > 2
    assert [run["warnings"] for run in cold + [warm]] == [[], [], []]


# Loads entries in a process with JAX alone and calls them: an executable's code must be in its
# entry, not only in the process that wrote it.
LOAD_AND_CALL = f"""
import pickle, sys
import jax, numpy as np
from jax.experimental import serialize_executable
for path in sys.argv[1:]:
    body = open(path, "rb").read()[{len(executable_cache.FORMAT) + 32}:]
    payload, in_tree, out_tree, devices = pickle.loads(body)
    exe = serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=[jax.devices()[i] for i in devices])
    print(exe(np.arange(4, dtype=np.float32)).tolist())
"""


def fusions(x):
    return jnp.sin(jnp.arange(16.0) * x[0]).reshape(4, 4) @ jnp.cos(x)


def test_an_executable_read_from_jax_cache_is_written_from_the_bytes_jax_read(
        tmp_path, monkeypatch):
    """jaxlib 0.11.2 on CPU: an executable that JAX's persistent cache (on for the whole test
    run, conftest) deserialized serializes without its code; its entry takes JAX's bytes."""
    read = []
    capture = executable_cache._jax_cc.extract_executable_and_time
    monkeypatch.setattr(executable_cache._jax_cc, "extract_executable_and_time",
                        lambda data: read.append(capture(data)) or read[-1])
    f, args = jax.jit(fusions), (np.arange(4, dtype=np.float32),)
    expected = np.asarray(fusions(*args)).tolist()
    paths = []
    for name in ("first", "from-jax-cache"):
        jax.clear_caches()  # the second compile reads JAX's persistent cache
        cache = ExecutableCache.open(str(tmp_path / name))
        cache.get_or_compile("fusions", f, args, {}, None)
        (entry,) = (tmp_path / name / "executables").iterdir()
        paths.append(str(entry))
    assert read, "JAX's persistent cache was not read"
    assert read[-1][0] in open(paths[1], "rb").read()  # the bytes JAX read, as they were
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", LOAD_AND_CALL, *paths], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [json.loads(line) for line in run.stdout.splitlines()[-2:]] == [expected] * 2


def twice(x, y, scale=2):
    return x * scale + y


def test_the_key_changes_with_whatever_shapes_the_program(tmp_path, monkeypatch):
    cache = ExecutableCache(str(tmp_path))
    x, y = np.ones((4, 8), np.float32), jnp.zeros((8,), jnp.float32)
    key = cache.key("f", (x, y), {"scale": 2}, ("ctx", 1))
    assert cache.key("f", (x, y), {"scale": 2}, ("ctx", 1)) == key  # no tracing: a hash
    changed = [
        cache.key("g", (x, y), {"scale": 2}, ("ctx", 1)),  # another program
        cache.key("f", (x, y), {"scale": 3}, ("ctx", 1)),  # a static argument (bucket)
        cache.key("f", (x, y), {"scale": 2}, ("ctx", 2)),  # the runner's context (config)
        cache.key("f", (x[:2], y), {"scale": 2}, ("ctx", 1)),  # a shape
        cache.key("f", (x.astype(np.float16), y), {"scale": 2}, ("ctx", 1)),  # a dtype
        cache.key("f", ((x,), y), {"scale": 2}, ("ctx", 1)),  # the pytree structure
        cache.key("f", (x, jax.ShapeDtypeStruct(y.shape, y.dtype)), {"scale": 2},
                  ("ctx", 1)),  # no sharding (placed where the program runs) vs committed
    ]
    monkeypatch.setattr(executable_cache, "environment", lambda: "another jaxllm source")
    changed.append(cache.key("f", (x, y), {"scale": 2}, ("ctx", 1)))
    assert len(set(changed + [key])) == len(changed) + 1


def test_the_environment_has_xla_flags_and_not_provenance(monkeypatch):
    def environment(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        executable_cache.environment.cache_clear()
        return executable_cache.environment()

    try:
        base = environment()
        assert environment(JAXLLM_COMMIT="abc1234", JAXLLM_API_KEY="secret") == base
        assert environment(XLA_FLAGS="--xla_gpu_autotune_level=0") != base
    finally:
        monkeypatch.undo()
        executable_cache.environment.cache_clear()


def test_the_source_hash_changes_with_any_source_file(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("A = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("B = 2\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not source")
    roots = [str(tmp_path / "pkg")]
    before = hash_sources(roots)
    (tmp_path / "pkg" / "notes.txt").write_text("still not source")
    assert hash_sources(roots) == before
    (tmp_path / "pkg" / "sub" / "b.py").write_text("B = 3\n")
    edited = hash_sources(roots)
    (tmp_path / "pkg" / "sub" / "b.py").rename(tmp_path / "pkg" / "b.py")
    assert len({before, edited, hash_sources(roots)}) == 3
    assert len(executable_cache.source_hash()) == 64  # this checkout's jaxllm + pallas_kernels


def test_a_corrupt_entry_is_compiled_again_with_a_warning_and_replaced(tmp_path, caplog):
    f = jax.jit(twice, static_argnames="scale")
    args, static = (np.arange(4, dtype=np.float32), np.ones(4, np.float32)), {"scale": 3}
    cache = ExecutableCache(str(tmp_path))
    exe = cache.get_or_compile("twice", f, args, static, None)
    assert (cache.num_compiled, cache.num_loaded) == (1, 0)
    (entry,) = tmp_path.iterdir()
    whole = entry.read_bytes()
    for damaged in (whole[:len(whole) // 2], b"not an entry", whole[:-1] + bytes([whole[-1] ^ 1])):
        entry.write_bytes(damaged)
        again = ExecutableCache(str(tmp_path))  # a fresh process's view of the directory
        with caplog.at_level(logging.WARNING, "jaxllm.engine.executable_cache"):
            caplog.clear()
            exe = again.get_or_compile("twice", f, args, static, None)
        assert (again.num_compiled, again.num_loaded) == (1, 0)
        assert "does not load" in caplog.text and "compiling it again" in caplog.text
        np.testing.assert_array_equal(exe(*args), args[0] * 3 + 1)
        assert entry.read_bytes() == whole  # replaced by a whole entry
    loaded = ExecutableCache(str(tmp_path))
    exe = loaded.get_or_compile("twice", f, args, static, None)
    assert (loaded.num_compiled, loaded.num_loaded) == (0, 1)
    np.testing.assert_array_equal(exe(*args), args[0] * 3 + 1)


def test_an_unusable_directory_turns_the_cache_off_with_a_warning(tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    with caplog.at_level(logging.WARNING, "jaxllm.engine.executable_cache"):
        assert ExecutableCache.open(str(tmp_path / "a-file" / "cache")) is None
    assert "cannot be used" in caplog.text
    assert ExecutableCache.open(str(tmp_path / "ok")).directory == str(
        tmp_path / "ok" / "executables")


def test_an_eager_engine_has_no_executable_cache(tmp_path):
    from tiny_models import TINY_CONFIGS

    from jaxllm import EngineConfig, LLMEngine
    from jaxllm.loading import LoadedModel
    from jaxllm.models.llama import param_shapes

    cfg = TINY_CONFIGS["qwen2_bias"]
    params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), param_shapes(cfg, jnp.float32))
    model = LoadedModel("tiny", cfg, params, None, jnp.float32)
    engine = LLMEngine(EngineConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32,
                                    block_size=8, num_gpu_blocks_override=16,
                                    enforce_eager=True, compilation_cache_dir=str(tmp_path)),
                       model=model, progress=False)
    assert engine.runner.executable_cache is None and engine.runner.warm_up_report is None
    assert not (tmp_path / "executables").exists()
