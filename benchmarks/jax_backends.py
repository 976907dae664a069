"""The JAX backends of ``bench throughput`` (``jaxllm`` and ``jax-static``), run in the
benchmark's process; :mod:`benchmarks.throughput` describes what each one measures."""

from __future__ import annotations

import time

import numpy as np
from jaxllm.benchmarks.datasets import Request


def device_bytes_in_use() -> int | None:
    import jax

    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_in_use")


def run_jaxllm(model, requests: list[Request], args) -> dict:
    from tqdm.auto import tqdm

    from jaxllm import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override, enforce_eager=args.enforce_eager,
        unroll_layers=args.unroll_layers,
        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
        disable_log_stats=True)
    engine = LLMEngine(config, model=model, progress=not args.no_progress)
    # Offline, as jaxllm.LLM.generate (and vLLM's LLM.generate): only finished requests come
    # back, no per-step partial output for every running request.
    engine.stream_outputs = False
    phases = ("schedule_seconds", "prepare_seconds", "update_seconds", "output_seconds",
              "device_wait_seconds")
    before = {p: getattr(engine.stats, p) for p in phases} | {"steps": engine.stats.num_steps}
    start = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(str(i), prompt_token_ids=list(r.prompt_ids), params=SamplingParams(
            n=args.n, temperature=1.0, max_tokens=r.output_len, ignore_eos=True, seed=i))
    produced = 0
    # JAX's own peak counts compile-time scratch (the GEMM autotuner's); the generation's peak is
    # what is held between steps (weights, pool) plus the largest step's temporaries.
    held = device_bytes_in_use()
    with tqdm(total=len(requests), desc="jaxllm", unit="req", disable=args.no_progress) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    produced += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
            if held is not None and engine.stats.num_steps % 16 == 0:
                held = max(held, device_bytes_in_use() or 0)
    elapsed = time.perf_counter() - start
    s = engine.stats
    steps = max(1, s.num_steps - before["steps"])
    # Where a step's time goes: host work on the critical path (schedule, prepare, update),
    # host work overlapped with the device (output), and waiting for the device.
    step_ms = {p.removesuffix("_seconds") + "_ms": 1e3 * (getattr(s, p) - before[p]) / steps
               for p in phases}
    memory = {} if held is None else {
        "generation_peak_bytes": held + engine.runner.max_step_temp_bytes,
        "held_bytes": held, "max_step_temp_bytes": engine.runner.max_step_temp_bytes}
    return {"elapsed_s": elapsed, "generated_tokens": produced, "steps": s.num_steps,
            "step_ms": 1e3 * elapsed / steps, "step_phases_ms": step_ms,
            "kv_waste": 1 - s.kv_slots_used / max(1, s.kv_slots_reserved),
            "num_gpu_blocks": engine.kv_plan.num_gpu_blocks,
            "stream_outputs": engine.stream_outputs,
            "warm_up_s": getattr(engine, "warm_up_seconds", None), **memory,
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


def static_kv_waste(batches, batch_size: int) -> float:
    """Share of reserved contiguous KV slots holding no useful token, summed over decode steps."""
    capacity = static_capacity(batches)
    reserved = used = 0
    for chunk, width, new in batches:
        steps = np.arange(1, new + 1)  # tokens generated after each decode step
        reserved += batch_size * (width + capacity) * new
        for r in chunk:
            used += int((r.prompt_len + np.minimum(steps, r.output_len)).sum())
    return 1 - used / max(1, reserved)


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
        return jaxllm.generate(params, ids, lens, key, config=model.config,
                               max_new_tokens=capacity, row_max_new_tokens=new,
                               temperature=1.0, block_size=args.block_size).tokens

    compile_start = time.perf_counter()  # one shape: compile (and run once) before timing
    call = jax.jit(generate).lower(model.params, *arrays[0], jax.random.key(0)).compile()
    jax.block_until_ready(call(model.params, *arrays[0], jax.random.key(0)))
    compile_s = time.perf_counter() - compile_start
    held = device_bytes_in_use()  # weights and the batches' inputs; the cache is a temporary
    plan = call.memory_analysis()
    temp = int(getattr(plan, "temp_size_in_bytes", 0) or 0) + int(
        getattr(plan, "output_size_in_bytes", 0) or 0)
    memory = {} if held is None else {"generation_peak_bytes": held + temp, "held_bytes": held,
                                      "max_step_temp_bytes": temp}
    start = time.perf_counter()
    for i, (ids, lens, new) in enumerate(tqdm(arrays, desc="jax-static", unit="batch",
                                               disable=args.no_progress)):
        jax.block_until_ready(call(model.params, ids, lens, new, jax.random.key(i)))
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "generated_tokens": sum(r.output_len for r in requests)
            * args.n, "num_batches": len(batches), "batch_size": batch_size,
            "output_capacity": capacity, "warm_up_s": compile_s, **memory,
            "kv_waste": static_kv_waste(batches, batch_size)}
