"""``bench latency``: decode step time at several batch sizes vs the memory roofline.

    python -m jaxllm.benchmarks latency --model llama-3-8b --load-format dummy --dtype bfloat16 \\
        --batch-sizes 1,32,256 --context-len 1024

What is timed: one decode step of the jitted model forward (the engine's
``forward(params, kv_pool, batch) -> (logits, kv_pool)`` with the pool donated, as the engine's
runner calls it) for B sequences that each hold ``--context-len`` tokens in the paged pool
(blocks laid out contiguously per sequence) and add one token; the engine's sampler in its
all-greedy variant is included. The pool holds zeros: attention reads the same bytes whatever
they hold. Median of ``--iters`` steps after warm-up, each synchronised with
``block_until_ready`` (``step ms``, its launch included), and the same steps launched back to
back, each with a fresh batch buffer (``b2b step ms``: how the engine's async decode runs: the
larger of the host's launch and the device's step). ``--device-time`` adds the device's own
time a step (``device ms``): the same back-to-back steps traced by the profiler, the union of
their kernels' intervals divided by the steps, a figure a slow host cannot inflate. The
engine's host work per step is in ``benchmarks/engine_step.py``.

Roofline (``../shared/reference/performance.md`` section 6): a decode step must read every
weight once and every sequence's K and V once, so

    bytes(B) = weight bytes + B * context * 2 * layers * kv_heads * head_dim * dtype bytes
    roofline(B) = bytes(B) / bandwidth        reported: % of roofline = roofline(B) / measured

``bandwidth`` is measured on this device as an elementwise copy (read + write bytes / time,
``--copy-mib``), or given with ``--bandwidth-gbps``. With ``--peak-tflops`` the compute bound
``B * 2 * (matmul params + 2 * layers * q_heads * head_dim * context) / peak`` is also shown
and the roofline is the larger of the two.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import tempfile
import time

import numpy as np
from jaxllm.benchmarks.provenance import source_commit
from jaxllm.benchmarks.step_profile import add_gemv_overrides_argument

from jaxllm.quantization.config import QUANTIZATION_NAMES


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto",
                        choices=["auto", "safetensors", "gguf", "dummy"])
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    parser.add_argument("--batch-sizes", default="1,32,256")
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--pool-blocks", type=int, default=None,
                        help="KV pool size in blocks (default: just what the batch needs; an "
                        "engine-sized pool shows how the compiled step treats a large pool)")
    parser.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None,
                        help="compile the layer stack unrolled (the engine's unroll_layers; "
                        "default: on GPU, as the engine)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="shard the model over this many devices (the roofline is then "
                        "per device: its share of the weights and of the KV cache)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="split the layers into this many stages (tp x pp devices; the "
                        "roofline is then one device's share of weights and KV cache, as if "
                        "the stages never waited on each other)")
    parser.add_argument("--pp-micro-batches", type=int, default=None,
                        help="with -pp: micro-batches per decode step (default: the engine's "
                        "rule, jaxllm.parallel.pipeline.num_micro_batches)")
    add_gemv_overrides_argument(parser)
    parser.add_argument("--quantization", "-q", default=None,
                        choices=QUANTIZATION_NAMES,
                        help="int8 weight-only or fp8 W8A8 quantized at load time (dummy weights "
                        "too); awq, gptq: a 4-bit checkpoint's own. The roofline counts the "
                        "bytes the quantized weights actually hold")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the pool's dtype, as the engine's flag (fp8: half the KV bytes, "
                        "counted so in the roofline)")
    parser.add_argument("--device-time", action="store_true",
                        help="also trace the back-to-back steps with the profiler and report "
                        "the device's busy time a step (independent of the host's launch)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup-iters", type=int, default=3)
    parser.add_argument("--bandwidth-gbps", type=float, default=None,
                        help="device bandwidth in GB/s (default: measure a copy)")
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="copy size for the bandwidth measurement (default 4096 on GPU, "
                             "64 on CPU)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--no-progress", action="store_true")


def measure_bandwidth_gbps(size_mib: int, reps: int = 10) -> float:
    """Elementwise copy ``x + 1`` over ``size_mib`` MiB of float32: (read + write) bytes / time,
    the dispatch time of an empty program subtracted (the same method and ceiling as
    ``benchmarks/kernels.py``; timing each call from the host alone read 2.8 instead of 3.86
    TB/s on the H200)."""
    import jax
    import jax.numpy as jnp
    from jaxllm.benchmarks.kernels import dispatch_time, run_timed

    x = jnp.zeros(size_mib * 2**20 // 4, jnp.float32)
    seconds = max(run_timed(jax.jit(lambda a: a + 1.0), (x,), reps=reps) - dispatch_time(), 1e-9)
    return 2 * x.nbytes / seconds / 1e9


def kv_bytes_per_token(cfg, itemsize: int) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


def roofline_s(weight_bytes: int, cfg, itemsize: int, batch: int, context: int,
               bandwidth_gbps: float, matmul_params: int = 0,
               peak_tflops: float | None = None, tensor_parallel_size: int = 1) -> float:
    """Lower bound on one decode step's time (seconds). Tensor parallel: ``weight_bytes`` is
    one device's share, and each device reads 1 / size of the KV cache."""
    kv_bytes = batch * context * kv_bytes_per_token(cfg, itemsize) / tensor_parallel_size
    t_mem = (weight_bytes + kv_bytes) / (bandwidth_gbps * 1e9)
    if peak_tflops is None:
        return t_mem
    attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context
    t_comp = batch * 2 * (matmul_params + attn) / (peak_tflops * 1e12)
    return max(t_mem, t_comp)


def compile_decode_step(model, batch_size: int, context: int, *, block_size: int = 16,
                        backend: str = "auto", pool_blocks: int | None = None,
                        micro_batches: int | None = None, kv_dtype=None):
    """One greedy decode step of ``batch_size`` sequences at ``context`` tokens, compiled (the
    pool donated; under tensor parallelism split by KV head as the engine splits it). Returns
    ``(step, pool, batch)``: ``step(params, pool, batch) -> (tokens, pool)``."""
    import jax

    from jaxllm import SeqChunk, make_forward, new_kv_pool, pack_batch
    from jaxllm.quantization.compile_options import forward_compiler_options
    from jaxllm.sampler_rows import build_sampling_metadata
    from jaxllm.sampling import sample

    cfg = model.config
    blocks_per_seq = -(-(context + 1) // block_size)
    num_blocks = max(pool_blocks or 0, 1 + batch_size * blocks_per_seq)

    pool = new_kv_pool(cfg, num_blocks, block_size, kv_dtype or model.dtype,
                       unroll_layers=model.unroll_layers, mesh=model.mesh)
    pool_out = {} if model.mesh is None else {
        "out_shardings": jax.tree.map(lambda x: x.sharding, pool)}
    chunks = [SeqChunk([100 + i % 50], context,
                       list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)))
              for i in range(batch_size)]
    batch = jax.device_put(pack_batch(chunks, block_size))
    forward = make_forward(cfg, model.dtype, backend, model.mesh, micro_batches=micro_batches)
    greedy_rows = build_sampling_metadata([], batch_size, 0, 0)  # padding rows are greedy

    def step(params, kv_pool, batch):
        logits, kv_pool = forward(params, kv_pool, batch)
        if pool_out:  # the pool keeps its split across steps
            kv_pool = jax.lax.with_sharding_constraint(kv_pool, pool_out["out_shardings"])
        return sample(logits, greedy_rows, all_greedy=True, use_top_k_top_p=False).sampled, \
            kv_pool

    # The engine's compile options for the model's quantization (FP8: XLA's GEMM autotuning at
    # the engine's level; RESULTS.md, 2026-12-04: without them the FP8 step here was not the
    # engine's).
    step = jax.jit(step, donate_argnums=(1,)).lower(model.params, pool, batch).compile(
        compiler_options=forward_compiler_options(model.quantization))
    return step, pool, batch


def time_decode_step(model, batch_size: int, context: int, *, block_size: int = 16,
                     backend: str = "auto", iters: int = 20, warmup: int = 3,
                     pool_blocks: int | None = None, micro_batches: int | None = None,
                     kv_dtype=None, device_time: bool = False) -> dict:
    """Seconds of one decode step: ``step`` = median of steps each waited for (its launch
    included: what a lone step costs), ``launch`` = median of the call alone (the host
    blocked), ``back_to_back`` = wall / steps of ``iters`` steps launched without waiting,
    each with a freshly transferred batch (how the engine's async decode runs: the larger of
    the host's and the device's cost per step), with ``device_time`` ``device`` = the device's
    busy time a step over the same steps traced. Also the compiled step's temporary bytes."""
    import jax

    step, pool, batch = compile_decode_step(model, batch_size, context, block_size=block_size,
                                            backend=backend, pool_blocks=pool_blocks,
                                            micro_batches=micro_batches, kv_dtype=kv_dtype)
    # XLA's plan beyond the pool: a pool-sized figure here means the pool is not updated in place.
    temp_bytes = int(getattr(step.memory_analysis(), "temp_size_in_bytes", 0) or 0)
    print(f"batch {batch_size}: compiled step needs {temp_bytes / 1e9:.2f} GB of temporaries "
          f"(pool {sum(x.nbytes for x in jax.tree.leaves(pool)) / 1e9:.2f} GB)", flush=True)
    for _ in range(warmup):
        tokens, pool = step(model.params, pool, batch)
    jax.block_until_ready(tokens)
    times, launches = [], []
    for _ in range(iters):
        t = time.perf_counter()
        tokens, pool = step(model.params, pool, batch)
        launches.append(time.perf_counter() - t)
        jax.block_until_ready(tokens)
        times.append(time.perf_counter() - t)
    host_batch = jax.device_get(batch)

    def back_to_back_steps(pool, trace_dir: str | None = None):
        fresh = jax.block_until_ready([jax.device_put(host_batch) for _ in range(iters)])
        if trace_dir:
            jax.profiler.start_trace(trace_dir)
        try:
            outs, start = [], time.perf_counter()
            for b in fresh:
                tokens, pool = step(model.params, pool, b)
                outs.append(tokens)
            jax.block_until_ready(outs)
            return (time.perf_counter() - start) / iters, pool
        finally:
            if trace_dir:
                jax.profiler.stop_trace()

    back_to_back, pool = back_to_back_steps(pool)
    timed = {"step": float(np.median(times)), "launch": float(np.median(launches)),
             "back_to_back": back_to_back, "temp_bytes": temp_bytes}
    if device_time:
        with tempfile.TemporaryDirectory() as trace_dir:
            _, pool = back_to_back_steps(pool, trace_dir)
            timed["device"] = device_busy_s(trace_dir) / iters
    return timed


def trace_summary(trace_dir: str, top: int = 0) -> dict:
    """``step_profile.summarize_trace`` of the profiler trace under ``trace_dir`` (its
    ``top`` kernel groups); a trace without GPU kernels is an error, never a zero."""
    from jaxllm.benchmarks.step_profile import summarize_trace

    [path] = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    summary = summarize_trace(path, [], top=top)
    if "error" in summary:
        raise RuntimeError(f"--device-time: {summary['error']}")
    return summary


def device_busy_s(trace_dir: str) -> float:
    """Seconds the device was busy in the profiler trace under ``trace_dir``: the union of
    every GPU stream's kernel and copy intervals."""
    return trace_summary(trace_dir)["busy_ms"] / 1e3


def traced_calls(fn, args, reps: int = 5, top: int = 0) -> dict:
    """:func:`trace_summary` of ``reps`` calls of ``fn(*args)`` (warm) launched back to back
    under the profiler: figures a host slower than the calls cannot inflate, as it does a
    wall-clock time."""
    import jax

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            jax.block_until_ready([fn(*args) for _ in range(reps)])
        finally:
            jax.profiler.stop_trace()
        return trace_summary(trace_dir, top)


def traced_busy_s(fn, args, reps: int = 5) -> float:
    """The device's busy seconds a call of ``fn(*args)``, from :func:`traced_calls`."""
    return traced_calls(fn, args, reps)["busy_ms"] / 1e3 / reps


def run(args: argparse.Namespace) -> dict:
    import jax
    from tqdm.auto import tqdm

    import jaxllm
    from jaxllm.engine.engine_config import resolve_unroll_layers
    from jaxllm.engine.int4_layout import with_int4_layout
    from jaxllm.layers.linear import int4_hopper_mode, one_layout
    from jaxllm.parallel.pipeline import bubble_fraction, num_micro_batches

    if args.device_time and jax.default_backend() == "cpu":
        raise SystemExit("--device-time reads the GPU's kernels from a profiler trace: it needs "
                         "a GPU (this backend is cpu)")
    if args.gemv_overrides:
        from jaxllm.benchmarks.step_profile import override_gemv

        override_gemv(args.gemv_overrides)  # (its cache directory: the engine's, unused here)
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    unroll = resolve_unroll_layers(args.unroll_layers, jax.default_backend())
    # Loaded in the layout the engine would run (no second copy made to re-lay it out).
    model = jaxllm.load_model(args.model, dtype=args.dtype, load_format=args.load_format,
                              seed=args.seed, tensor_parallel_size=tp, unroll_layers=unroll,
                              quantization=args.quantization, pipeline_parallel_size=pp)
    # the 4-bit weights N-major under JAXLLM_INT4_HOPPER, as the engine stores them
    model = with_int4_layout(model, int4_hopper_mode(), donate=True)
    from jaxllm.kv_pool import kv_cache_dtype

    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, model.dtype)
    cfg, itemsize = model.config, np.dtype(kv_dtype).itemsize
    read = one_layout(model.params)  # a step reads one of a projection's two layouts
    leaves = jax.tree.leaves(read)
    first = leaves[0].sharding.device_set and min(leaves[0].sharding.device_set, key=str)
    # One device's share: what each device reads per step (replicated leaves whole).
    from jaxllm.engine.device_memory import stored_bytes
    weight_bytes = sum(stored_bytes(s.data) for x in leaves for s in x.addressable_shards
                       if s.device == first)
    # Matmul params: every projection kernel (either layout, quantized or not), plus the
    # embedding when it doubles as the LM head.
    matmul_params = sum(
        x.size for path, x in jax.tree_util.tree_leaves_with_path(read)
        if "kernel" in jax.tree_util.keystr(path) and not jax.tree_util.keystr(path).endswith(
            "scale")) + (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)
    on_gpu = jax.default_backend() != "cpu"
    if args.bandwidth_gbps is not None:
        bandwidth, how = args.bandwidth_gbps, "given"
    else:
        size = args.copy_mib or (4096 if on_gpu else 64)
        bandwidth, how = measure_bandwidth_gbps(size), f"measured copy of {size} MiB"
    quant = model.quantization.describe() if model.quantization else "not quantized"
    print(f"{model.name} {model.dtype.name} ({quant}): weights {weight_bytes / 1e9:.3f} GB, KV "
          f"{kv_bytes_per_token(cfg, itemsize) / 1024:.1f} KiB/token; bandwidth "
          f"{bandwidth:.1f} GB/s ({how})")
    rows = []
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for b in tqdm(batch_sizes, desc="batch sizes", disable=args.no_progress):
        timed = time_decode_step(
            model, b, args.context_len, block_size=args.block_size,
            backend=args.attention_backend, iters=args.iters, warmup=args.warmup_iters,
            pool_blocks=args.pool_blocks, micro_batches=args.pp_micro_batches,
            kv_dtype=kv_dtype, device_time=args.device_time)
        measured, b2b = timed["step"], timed["back_to_back"]
        micro = min(args.pp_micro_batches or num_micro_batches(b, pp), b) if pp > 1 else 1
        bound = roofline_s(weight_bytes, cfg, itemsize, b, args.context_len, bandwidth,
                           matmul_params / (tp * pp), args.peak_tflops, tp * pp)
        rows.append({"batch_size": b, "context_len": args.context_len,
                     "step_ms": 1e3 * measured, "launch_ms": 1e3 * timed["launch"],
                     "temp_bytes": timed["temp_bytes"],
                     "roofline_ms": 1e3 * bound,
                     "pct_of_roofline": 100 * bound / measured,
                     "output_tokens_per_s": b / measured,
                     "back_to_back_step_ms": 1e3 * b2b,
                     "back_to_back_pct_of_roofline": 100 * bound / b2b,
                     **({"device_step_ms": 1e3 * timed["device"],
                         "device_pct_of_roofline": 100 * bound / timed["device"]}
                        if "device" in timed else {}),
                     # Pipeline stages: the step's micro-batches and the idle share of them.
                     "micro_batches": micro,
                     "bubble_fraction": bubble_fraction(micro, pp)})
    print(f"layers {'unrolled' if unroll else 'scanned'}"
          + (f", {pp} pipeline stages" if pp > 1 else ""))
    print(f"{'batch':>6}{'step ms':>10}{'launch ms':>11}{'roofline ms':>13}{'% roofline':>12}"
          f"{'tok/s':>11}{'b2b step ms':>13}{'b2b % roofline':>16}"
          + (f"{'device ms':>11}{'device % roofline':>19}" if args.device_time else ""))
    for r in rows:
        print(f"{r['batch_size']:>6}{r['step_ms']:>10.3f}{r['launch_ms']:>11.3f}"
              f"{r['roofline_ms']:>13.3f}{r['pct_of_roofline']:>11.1f}%"
              f"{r['output_tokens_per_s']:>11.1f}{r['back_to_back_step_ms']:>13.3f}"
              f"{r['back_to_back_pct_of_roofline']:>15.1f}%"
              + (f"{r['device_step_ms']:>11.3f}{r['device_pct_of_roofline']:>18.1f}%"
                 if "device_step_ms" in r else ""))
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "commit": source_commit(),
              "model": model.name, "dtype": model.dtype.name,
              "device": jax.devices()[0].device_kind, "weight_bytes": int(weight_bytes),
              "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
              "bandwidth_gbps": bandwidth, "bandwidth_source": how,
              "peak_tflops": args.peak_tflops, "unroll_layers": unroll, "rows": rows,
              "args": {k: v for k, v in vars(args).items() if k not in ("handler", "argv")}}
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result
