"""The engine end to end on a tiny random model: continuous batching, preemption, prefix
caching, parallel sampling, leaks and recompiles. The reference for every greedy output is
``jaxllm.generate`` run on one prompt at a time (a separate, contiguous-pool code path)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import TINY_CONFIGS, random_params

import jaxllm
from jaxllm.engine.engine_config import EngineConfig, resolve_unroll_layers
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.loading import LoadedModel
from jaxllm.sampling_params import SamplingParams

CFG = TINY_CONFIGS["qwen2_bias"]
BLOCK = 8


@pytest.fixture(scope="module")
def model():
    return LoadedModel("tiny", CFG, random_params(CFG, seed=21), None, jnp.float32)


def make_engine(model, **overrides):
    args = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, block_size=BLOCK,
                num_gpu_blocks_override=160, enforce_eager=True, compilation_cache_dir=None)
    return LLMEngine(EngineConfig(**args | overrides), model=model, progress=False)


# A small pool (15 usable blocks of 8 tokens) for 96-token requests: far less than a workload
# needs at once. The preemption, recompilation and stress tests share it, so their engines run
# the same step programs (compiled once per run, then read from the compilation cache).
SMALL_POOL = dict(num_gpu_blocks_override=16, max_model_len=96)


def workload(count=18, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, CFG.vocab_size, int(n)).tolist()
               for n in rng.integers(2, 70, count)]
    max_tokens = [int(n) for n in rng.integers(1, 24, count)]
    return prompts, max_tokens


REF_WIDTH, REF_NEW = 128, 24


@functools.cache
def reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy tokens from jaxllm.generate; one fixed padded shape, so it compiles once."""
    assert len(prompt) <= REF_WIDTH and max_tokens <= REF_NEW
    ids = np.zeros((1, REF_WIDTH), np.int32)
    ids[0, :len(prompt)] = prompt
    out = _reference_generate(jnp.asarray(ids), jnp.asarray([len(prompt)]))
    return np.asarray(out.tokens[0]).tolist()[:max_tokens]


@functools.lru_cache(maxsize=1)
def _reference_params():
    return random_params(CFG, seed=21)


def _reference_generate(ids, lens):
    return jaxllm.generate(_reference_params(), ids, lens, jax.random.key(0), config=CFG,
                           max_new_tokens=REF_NEW, block_size=BLOCK)


def run_all(engine, prompts, max_tokens, **params):
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(str(i), prompt_token_ids=p,
                           params=SamplingParams(temperature=0, max_tokens=m, ignore_eos=True,
                                                 **params))
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 10_000, "engine made no progress"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


def assert_no_leak(engine):
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_gpu_blocks - 1
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks
    assert engine.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_continuous_batching_equals_one_at_a_time(model, async_scheduling, monkeypatch):
    from jaxllm.engine.step_handles import PendingStep

    prompts, max_tokens = workload()
    engine = make_engine(model, async_scheduling=async_scheduling)
    events = []  # launches, waits for the device, output building; in order
    prepare, emit, wait = engine.runner.prepare_forward, engine._emit_outputs, PendingStep.wait
    engine.runner.prepare_forward = lambda *a: (events.append("launch"), prepare(*a))[1]
    engine._emit_outputs = lambda: (events.append("emit"), emit())[1]
    monkeypatch.setattr(PendingStep, "wait", lambda self: (events.append("wait"), wait(self))[1])
    outputs = run_all(engine, prompts, max_tokens)
    for prompt, m, out in zip(prompts, max_tokens, outputs, strict=True):
        assert out.outputs[0].token_ids == reference(tuple(prompt), m)
        assert out.outputs[0].finish_reason == "length"
    # Requests really shared steps and long prompts really were chunked.
    assert engine.stats.num_steps < sum(max_tokens)
    assert max(map(len, prompts)) > engine.config.max_num_batched_tokens
    assert_no_leak(engine)
    waits = [i for i, e in enumerate(events) if e == "wait"]
    assert len(waits) == engine.stats.num_steps
    after_wait = {events[i + 1] for i in waits if "launch" in events[i + 1:]}
    if async_scheduling:
        # Between waiting for step k and packing and launching step k+2 the host only
        # records k's tokens and schedules k+2: outputs are built after the launch.
        assert after_wait == {"launch"}
    else:
        assert after_wait == {"emit"}


@pytest.mark.parametrize("mode, async_scheduling, unroll_layers", [
    ("recompute", True, False), ("swap", True, False), ("recompute", False, False),
    ("swap", False, False), ("swap", True, True)])
def test_preemption_keeps_outputs_exact(model, mode, async_scheduling, unroll_layers):
    prompts, max_tokens = workload(16, seed=1)
    engine = make_engine(model, **SMALL_POOL, preemption_mode=mode, swap_space=0.01,
                         async_scheduling=async_scheduling, unroll_layers=unroll_layers)
    outputs = run_all(engine, prompts, max_tokens)
    assert engine.scheduler.num_preemptions > 0
    for prompt, m, out in zip(prompts, max_tokens, outputs, strict=True):
        assert out.outputs[0].token_ids == reference(tuple(prompt), m)
    assert_no_leak(engine)


def test_prefix_cache_hits_give_the_same_outputs(model):
    prompts, max_tokens = workload(6, seed=2)
    plain = run_all(make_engine(model), prompts, max_tokens)
    engine = make_engine(model, enable_prefix_caching=True)
    first = run_all(engine, prompts, max_tokens)
    again = run_all(engine, prompts, max_tokens)  # every full prompt block is cached now
    for a, b, c, prompt in zip(plain, first, again, prompts, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert c.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert engine.block_manager.prefix_cache_hits > 0
    assert_no_leak(engine)


def test_parallel_sampling_shares_prompt_blocks_and_is_seeded(model):
    prompt = list(range(3, 3 + 4 * BLOCK + 3))  # 4 full blocks + 3 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)

    def run(engine):
        engine.add_request("p", prompt_token_ids=prompt, params=params)
        group = engine.scheduler.waiting[0]
        while len(group.seqs) < 4:  # prompt chunks, then the fork and first samples
            out = engine.step()
        tables = [engine.block_manager.block_table(s.seq_id) for s in group.seqs]
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out = o
        return out, tables

    engine = make_engine(model)
    out, tables = run(engine)
    assert len(tables) == 4 and all(t == tables[0] for t in tables)  # one copy of the prompt
    assert engine.block_manager.num_gpu_blocks - 1 - engine.block_manager.num_free_blocks == 0
    samples = [tuple(o.token_ids) for o in out.outputs]
    assert len(samples) == 4 and len(set(samples)) > 1
    # The same seeds give the same samples, also through the unrolled layers (per-layer pool,
    # whose copy-on-write block copies then serve the forked sequences).
    again, _ = run(make_engine(model, unroll_layers=True))
    assert [tuple(o.token_ids) for o in again.outputs] == samples
    assert_no_leak(engine)


def test_abort_and_finish_free_every_block(model):
    prompts, max_tokens = workload(10, seed=3)
    engine = make_engine(model)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=p,
                           params=SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(5):
        engine.step()
    aborted = engine.abort_request([str(i) for i in range(0, 10, 2)])
    assert {o.request_id for o in aborted} == {str(i) for i in range(0, 10, 2)}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in aborted)
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(engine)


@pytest.mark.parametrize("unroll_layers", [False, True])
def test_no_recompilation_after_warm_up(model, unroll_layers, tmp_path, caplog, monkeypatch):
    from jaxllm.engine import model_runner

    # A compilation cache directory that cannot be used (here: a path through a file) is a
    # warning; the engine compiles without it.
    (tmp_path / "a-file").write_text("")
    cache_before = jax.config.jax_compilation_cache_dir
    # Each program's first run at warm-up, as on a GPU: every forward bucket and sampler
    # launched once, on empty batches that leave the pool as it was.
    launched = []
    launch_forward, launch_sampler = (model_runner.ModelRunner.launch_forward,
                                      model_runner.ModelRunner.launch_sampler_packed)
    monkeypatch.setattr(model_runner, "_runs_first_by_default", lambda: True)
    monkeypatch.setattr(model_runner.ModelRunner, "launch_forward", lambda self, prepared, *a: (
        launched.append(prepared.shape), launch_forward(self, prepared, *a))[1])
    monkeypatch.setattr(model_runner.ModelRunner, "launch_sampler_packed", lambda self, f, key,
                        md: (launched.append(key), launch_sampler(self, f, key, md))[1])
    engine = make_engine(model, **SMALL_POOL, enforce_eager=False, unroll_layers=unroll_layers,
                         compilation_cache_dir=str(tmp_path / "a-file" / "cache"))
    assert "cannot be used" in caplog.text and "without a persistent cache" in caplog.text
    assert jax.config.jax_compilation_cache_dir == cache_before
    runner = engine.runner
    compiled = runner.num_compilations
    shapes = runner.buckets.all_shapes()
    num_row_buckets = len({s.num_seqs for s in shapes})
    assert compiled == len(shapes) + 3 * num_row_buckets
    assert sorted(launched, key=repr) == sorted(
        list(shapes) + list(runner._sample_exe), key=repr)  # each once
    assert runner.num_forwards == runner.num_steps == 0
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(runner.kv_pool))
    traces = []
    listener = lambda name, *_, **__: traces.append(name) if "trace" in name else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        prompts, max_tokens = workload(12, seed=4)
        prompts = [p[:80] for p in prompts]
        outputs = run_all(engine, prompts, max_tokens)
        run_all(engine, prompts[:3], [40, 2, 7])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert runner.num_compilations == compiled
    assert traces == []
    for prompt, m, out in zip(prompts, max_tokens, outputs, strict=True):
        assert out.outputs[0].token_ids == reference(tuple(prompt), m)


def test_warm_up_drops_the_step_programs_traces(model):
    """Once every bucket is compiled, JAX's traces of the step programs (millions of Python
    objects for an unrolled model, walked by every full garbage collection) are dropped: a
    second ``lower`` of a warmed signature traces again, and a third hits the cache anew."""
    engine = make_engine(model, **SMALL_POOL, enforce_eager=False)
    runner = engine.runner
    _, jitted, args, static, _ = runner._forward_inputs(runner.buckets.all_shapes()[0])
    traces = []
    listener = lambda name, *_, **__: traces.append(name) if "trace" in name else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jitted.lower(*args, **static)
        retraced, traces[:] = bool(traces), []
        jitted.lower(*args, **static)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert retraced and traces == []


def test_bad_requests_are_refused_with_clear_errors(model):
    engine = make_engine(model)
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.add_request("a", prompt_token_ids=[1, CFG.vocab_size])
    with pytest.raises(ValueError, match="too long"):
        engine.add_request("b", prompt_token_ids=[1] * 128)
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("c", prompt_token_ids=[1], priority=3)
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("d", prompt="hello")
    engine.add_request("e", prompt_token_ids=[1, 2])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("e", prompt_token_ids=[1, 2])
    assert engine.get_num_unfinished_requests() == 1


@pytest.mark.slow
def test_engine_through_the_interpreted_pallas_kernels(model):
    """The engine's GPU path (Pallas decode and prefill kernels, fixed table width, decode
    flag) run by the Pallas interpreter on CPU: same tokens as the reference path."""
    prompts, max_tokens = workload(5, seed=6)
    max_tokens = [min(m, 6) for m in max_tokens]
    engine = make_engine(model, attention_backend="pallas_interpret", max_model_len=96)
    assert engine.runner.buckets.table_widths == (96 // BLOCK,)
    outputs = run_all(engine, prompts, max_tokens)
    for prompt, m, out in zip(prompts, max_tokens, outputs, strict=True):
        assert out.outputs[0].token_ids == reference(tuple(prompt), m)
    assert_no_leak(engine)


@pytest.mark.parametrize("unroll_layers", [False, True])
def test_activation_plan_is_compiled_for_either_pool(model, unroll_layers):
    """The GPU memory plan subtracts the largest step's temporaries (compiled, never run)."""
    from jaxllm.engine.kv_sizing import activation_bytes

    laid_out = model.with_layer_layout(unroll_layers)
    small = activation_bytes(laid_out, 16, 4, 8, "reference")
    large = activation_bytes(laid_out, 256, 8, 8, "reference")
    assert 0 < small < large


def test_layers_unroll_by_default_only_on_gpu(model):
    assert [resolve_unroll_layers(s, p) for s, p in [(None, "gpu"), (None, "cpu"),
                                                     (False, "gpu"), (True, "cpu")]] == [
        True, False, False, True]
    scanned = make_engine(model)  # this machine has no GPU
    assert scanned.config.unroll_layers is False
    assert isinstance(scanned.runner.kv_pool, jaxllm.KVPool)
    assert not isinstance(scanned.model.params["layers"], tuple)
    unrolled = make_engine(model, unroll_layers=True)
    assert isinstance(unrolled.runner.kv_pool, jaxllm.LayeredKVPool)
    # One param tree per layer (whole arrays for each layer's matmuls); the caller's model
    # keeps its stacked params.
    assert len(unrolled.model.params["layers"]) == CFG.num_hidden_layers
    assert not isinstance(model.params["layers"], tuple)
