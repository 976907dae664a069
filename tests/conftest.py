"""Shared fixtures: the real SmolLM2 model (loaded once), one SmolLM2 engine for the API and
server tests, and tiny random model helpers.

Compiled programs are reused across the whole run: one persistent XLA compilation cache
(a fresh temporary directory unless ``JAX_COMPILATION_CACHE_DIR`` names one) serves every
engine built here and every process started from here (server subprocesses, notebook
kernels), which inherit the settings below through the environment. An eager engine compiles
each step shape on first use; a second engine over the same model, pool and limits loads
those programs from the cache (~0.3 s a shape instead of ~2 s on 2 cores).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _compile_cache_dir() -> str:
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix="jaxllm-tests-xla-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# Read by jax at import, here and in every subprocess: cache every program, however quick.
os.environ["JAX_COMPILATION_CACHE_DIR"] = _compile_cache_dir()
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Parity tests compare float32 numerics with torch; keep XLA's CPU matmuls exact. Set for
# subprocesses too: the precision is part of a program's cache key.
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
# What an eager engine (enforce_eager) adds to XLA_FLAGS, set before any compile: the flags
# are part of the cache key, so programs compiled before and after the first eager engine,
# and in subprocesses, share entries.
if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402

assert jax.config.jax_default_matmul_precision == "highest"
# The limits of the shared SmolLM2 engine (test_llm_api, test_server) and of the other SmolLM2
# engines and servers that should reuse its compiled step shapes (test_server_faults,
# test_server_shutdown): the same limits and KV pool give the same programs. 129 blocks of 16
# tokens also hold one 2048-token request (test_server_shutdown's long stream).
SMOLLM2_ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                           num_gpu_blocks_override=129, enforce_eager=True,
                           compilation_cache_dir=None)


# `make test` runs files on two workers (--dist loadfile), in this order
# (--no-loadscope-reorder; xdist would otherwise queue files by test count, which put the
# single-test tensor-parallel file, ~190 s, last and left one core idle at the end). The
# longest files, as measured on 2 cores, go first; the rest fill in behind them.
LONGEST_FILES_FIRST = ("test_paged_attention_kernels.py", "test_tensor_parallel.py",
                       "test_notebooks.py", "test_bench_commands.py", "test_engine.py",
                       "test_model_invariants.py", "test_server.py", "test_engine_process.py",
                       "test_generate.py", "test_prefill_hopper.py")


# Most tests run tiny random models, whose programs cost far more to compile than to run: XLA's
# CPU optimizations (LLVM's) take a third of a tiny engine's compile time and buy nothing there,
# so those tests compile with them off. Tests over the real SmolLM2 weights compile as users do:
# unoptimized, its float32 forward runs ~3x slower. The setting is part of every program's
# compilation-cache key, so the two kinds of program never share an entry.
REAL_WEIGHT_FIXTURES = {"smollm2", "smollm2_llm"}


def runs_real_weights(item) -> bool:
    return (item.get_closest_marker("slow") is not None
            or not REAL_WEIGHT_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before any fixture of the test is set up: session fixtures compile under it too.
    jax.config.update("jax_disable_most_optimizations", not runs_real_weights(item))


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


@pytest.fixture(scope="session")
def smollm2_header():
    """The embedded model's config and tokenizer from its GGUF header alone (no weights), for
    tiny random models that borrow SmolLM2's vocabulary: those compile as tiny models."""
    from jaxllm.loading import default_model_path
    from jaxllm.loading.gguf_file import GGUFCheckpoint
    from jaxllm.loading.tokenizer import tokenizer_from_gguf

    checkpoint = GGUFCheckpoint(default_model_path())
    return checkpoint.config, tokenizer_from_gguf(checkpoint.metadata)


@pytest.fixture(scope="session")
def smollm2():
    import jaxllm

    return jaxllm.load_model(None, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2):
    """One eager SmolLM2 engine (``LLM``) for the whole run; every user leaves it idle with
    every KV block free (checked after each module)."""
    import jaxllm

    return jaxllm.LLM(smollm2, progress=False, **SMOLLM2_ENGINE_ARGS)


@pytest.fixture(scope="module")
def server(smollm2_llm):
    """A live OpenAI-compatible server over the shared SmolLM2 engine (tests/server_harness.py),
    one per test module that asks for it; a module with its own ``server`` fixture uses that."""
    from server_harness import serve_smollm2

    yield from serve_smollm2(smollm2_llm)


@pytest.fixture(scope="module")
def client(server):
    """The ``openai`` client of ``server``."""
    from server_harness import openai_client

    return openai_client(server)


def assert_engine_idle(engine) -> None:
    """Nothing queued, running or swapped, and every KV block back in the pool."""
    bm = engine.block_manager
    bm.check_invariants()
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_gpu_blocks - 1
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks


# The tiny Llama of the benchmark-command tests (test_bench_commands.py, test_bench_tools.py):
# a config.json that --load-format dummy fills with random weights.
TINY_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY_HF_CONFIG))
    return str(path)


def tiny_bench_args(config: str) -> list[str]:
    return ["--model", config, "--load-format", "dummy", "--dtype", "float32", "--no-progress"]
