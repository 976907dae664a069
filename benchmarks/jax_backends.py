"""The JAX backends of ``bench throughput`` (``jaxllm`` and ``jax-static``), run in the
benchmark's process; :mod:`benchmarks.throughput` describes what each one measures. Each returns
the output tokens it produced, counted from its outputs (``generated_tokens``), its KV usage
(:mod:`jaxllm.engine.kv_usage`) and its sampled peak memory (:mod:`benchmarks.device_memory`)."""

from __future__ import annotations

import time

import numpy as np
from jaxllm.benchmarks.datasets import Request
from jaxllm.benchmarks.device_memory import PeakSampler

from jaxllm.engine.kv_usage import KVUsage, contiguous_batch, engine_usage

MEMORY_SOURCE = "jax memory_stats bytes_in_use"


def device_bytes_in_use() -> int | None:
    import jax

    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_in_use")


def _planned_peak(held: int | None, temp: int) -> dict:
    """The extra, planned figure: bytes held before the clock + the largest compiled step's
    temporaries (XLA's memory analysis)."""
    if held is None:
        return {"max_step_temp_bytes": temp}
    return {"planned_peak_bytes": held + temp, "held_bytes": held, "max_step_temp_bytes": temp}


# What --structured-fraction constrains requests to: open-ended (free strings in a list), so
# a request usually runs to its output length, and every token is a grammar step.
STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "score": {"type": "number"}},
    "required": ["title", "tags"]}


def make_engine(model, args):
    """The engine ``bench throughput`` measures, offline as ``LLM.generate`` runs it."""
    from jaxllm import EngineConfig, LLMEngine

    config = EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override, enforce_eager=args.enforce_eager,
        unroll_layers=args.unroll_layers, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), disable_log_stats=True,
        attention_backend=getattr(args, "attention_backend", "auto"),
        **({"compilation_cache_dir": args.compilation_cache_dir}
           if getattr(args, "compilation_cache_dir", None) else {}))
    # The LLM class's default limits (offline: 16384 tokens a step on a large GPU).
    engine = LLMEngine(config, model=model, progress=not args.no_progress,
                       usage_context="llm_class")
    # Offline, as jaxllm.LLM.generate (and vLLM's LLM.generate): only finished requests come
    # back, no per-step partial output for every running request.
    engine.stream_outputs = False
    return engine


def add_workload(engine, requests: list[Request], args, tag: str = "") -> int:
    """Adds every request (every k-th under ``STRUCTURED_SCHEMA`` with
    ``--structured-fraction``); returns how many are constrained."""
    from jaxllm import SamplingParams
    from jaxllm.sampling_params import StructuredOutputsParams

    fraction = getattr(args, "structured_fraction", 0.0)
    constraint = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    every = round(1 / fraction) if fraction else 0  # every k-th request is constrained
    for i, r in enumerate(requests):
        constrained = bool(every) and i % every == 0
        engine.add_request(f"{tag}{i}", prompt_token_ids=list(r.prompt_ids),
                           params=SamplingParams(
                               n=args.n, temperature=1.0, max_tokens=r.output_len,
                               ignore_eos=True, seed=i,
                               structured_outputs=constraint if constrained else None))
    return sum(1 for i in range(len(requests)) if every and i % every == 0)


def run_jaxllm(model, requests: list[Request], args) -> dict:
    from tqdm.auto import tqdm

    from jaxllm.engine import gc_watch

    engine = make_engine(model, args)
    phases = ("schedule_seconds", "prepare_seconds", "update_seconds", "output_seconds",
              "device_wait_seconds", "bitmask_seconds", "bitmask_fill_seconds")
    before = {p: getattr(engine.stats, p) for p in phases} | {"steps": engine.stats.num_steps}
    kv_before = engine_usage(engine.stats)
    held = device_bytes_in_use()  # weights and pool, before the clock
    produced = 0
    with gc_watch.frozen_heap(), PeakSampler(device_bytes_in_use) as memory, tqdm(
            total=len(requests), desc="jaxllm", unit="req", disable=args.no_progress) as bar:
        start = time.perf_counter()
        num_constrained = add_workload(engine, requests, args)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:  # what the engine produced, not what was asked
                    produced += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
        elapsed = time.perf_counter() - start
    s = engine.stats
    steps = max(1, s.num_steps - before["steps"])
    # Where a step's time goes: host work on the critical path (schedule, prepare, update),
    # host work overlapped with the device (output), and waiting for the device.
    step_ms = {p.removesuffix("_seconds") + "_ms": 1e3 * (getattr(s, p) - before[p]) / steps
               for p in phases}
    return {"elapsed_s": elapsed, "generated_tokens": produced, "steps": s.num_steps,
            "step_ms": 1e3 * elapsed / steps, "step_phases_ms": step_ms,
            **(engine_usage(s) - kv_before).as_dict(),
            "num_gpu_blocks": engine.kv_plan.num_gpu_blocks,
            "stream_outputs": engine.stream_outputs,
            "structured_requests": num_constrained,
            "warm_up_s": getattr(engine, "warm_up_seconds", None),
            **memory.result(MEMORY_SOURCE),
            **_planned_peak(held, engine.runner.max_step_temp_bytes),
            "engine_config": {k: v for k, v in vars(engine.config).items()
                              if isinstance(v, (int, float, str, bool, type(None)))}}


def static_batches(requests: list[Request], batch_size: int, n: int = 1):
    """(rows, width, new) per static batch; rows = the requests (each repeated n times), width =
    the longest prompt of all batches rounded up to 128 (one compiled program serves every
    batch), new = the batch's longest output (every row of the batch decodes that many)."""
    rows = [r for r in requests for _ in range(n)]
    width = -(-max(r.prompt_len for r in rows) // 128) * 128
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        yield chunk, width, max(r.output_len for r in chunk)


def static_capacity(batches) -> int:
    """Output slots each row's contiguous cache holds: the longest output, rounded up to 16."""
    return -(-max(new for _, _, new in batches) // 16) * 16


def static_kv_usage(batches, batch_size: int) -> KVUsage:
    """KV usage over every decode step: each of the batch's ``batch_size`` rows (padding rows
    too) owns ``width + capacity`` contiguous slots while the batch runs."""
    capacity = static_capacity(batches)
    usage = KVUsage()
    for chunk, width, new in batches:
        usage += contiguous_batch([r.prompt_len for r in chunk], [r.output_len for r in chunk],
                                  new, rows=batch_size, width=width, cache_len=width + capacity)
    return usage


def produced_tokens(num_tokens: np.ndarray, chunk: list[Request]) -> int:
    """Useful tokens of a static batch from its outputs: row i's first ``output_len`` tokens of
    the ``num_tokens[i]`` it generated (rows past the chunk are padding)."""
    return sum(min(int(num_tokens[i]), r.output_len) for i, r in enumerate(chunk))


def run_jax_static(model, requests: list[Request], args) -> dict:
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    import jaxllm

    batch_size = args.jax_static_batch_size or args.max_num_seqs or 256
    batches = list(static_batches(requests, batch_size, args.n))
    capacity = static_capacity(batches)
    arrays = []
    for chunk, width, new in batches:
        ids = np.zeros((batch_size, width), np.int32)
        lens = np.ones(batch_size, np.int32)
        for i, r in enumerate(chunk):
            ids[i, :r.prompt_len] = r.prompt_ids
            lens[i] = r.prompt_len
        arrays.append((jnp.asarray(ids), jnp.asarray(lens), jnp.full(batch_size, new)))

    def generate(params, ids, lens, new, key):
        out = jaxllm.generate(params, ids, lens, key, config=model.config,
                              max_new_tokens=capacity, row_max_new_tokens=new,
                              temperature=1.0, block_size=args.block_size)
        return out.tokens, out.num_tokens

    compile_start = time.perf_counter()  # one shape: compile (and run once) before timing
    call = jax.jit(generate).lower(model.params, *arrays[0], jax.random.key(0)).compile()
    jax.block_until_ready(call(model.params, *arrays[0], jax.random.key(0)))
    compile_s = time.perf_counter() - compile_start
    held = device_bytes_in_use()  # weights and the batches' inputs; the cache is a temporary
    plan = call.memory_analysis()
    temp = int(getattr(plan, "temp_size_in_bytes", 0) or 0) + int(
        getattr(plan, "output_size_in_bytes", 0) or 0)
    counts = []
    with PeakSampler(device_bytes_in_use) as memory:
        start = time.perf_counter()
        for i, (ids, lens, new) in enumerate(tqdm(arrays, desc="jax-static", unit="batch",
                                                   disable=args.no_progress)):
            counts.append(jax.block_until_ready(
                call(model.params, ids, lens, new, jax.random.key(i)))[1])
        elapsed = time.perf_counter() - start
    produced = sum(produced_tokens(np.asarray(c), chunk)
                   for c, (chunk, _, _) in zip(counts, batches, strict=True))
    return {"elapsed_s": elapsed, "generated_tokens": produced,
            "num_batches": len(batches), "batch_size": batch_size,
            "output_capacity": capacity, "warm_up_s": compile_s,
            **memory.result(MEMORY_SOURCE), **_planned_peak(held, temp),
            **static_kv_usage(batches, batch_size).as_dict()}
