"""Where a tensor-parallel decode step spends its time: the collectives XLA placed in the
compiled step (counted in its optimized HLO), and, on GPU, a profiler trace of a few steps
split into collective kernels (all-reduce, all-gather ...) and the rest.

    python -m jaxllm.benchmarks.tp_profile --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 -tp 2 --batch-size 64 --context-len 1024 --output-json tp.json

Prints a table and writes JSON (and the trace directory, for Perfetto, under
``--trace-dir``). Without a GPU the trace holds no device kernels; the HLO counts still hold.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
               "all-to-all")
# GPU kernel names of collectives (NCCL's and XLA's own one-shot kernels).
COLLECTIVE_KERNEL = re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|"
                               r"allreduce|allgather", re.IGNORECASE)


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many of each collective the optimized HLO runs (async pairs counted once)."""
    counts = {}
    for name in COLLECTIVES:
        starts = len(re.findall(rf"\b{name}-start\(", hlo_text))
        counts[name] = starts or len(re.findall(rf"\b{name}\(", hlo_text))
    return counts


def device_kernel_times(trace_dir: str) -> dict | None:
    """Kernel time on the first GPU by kind, from the profiler's Perfetto trace: None when
    the trace has no GPU stream events (CPU runs)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True) + \
        glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        return None
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    process = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = sorted(pid for pid, name in process.items() if "GPU" in name or "gpu" in name)
    if not gpu:
        return None
    times: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("ph") != "X" or e.get("pid") != gpu[0]:
            continue
        if "Stream" not in thread.get((e["pid"], e.get("tid")), "Stream"):
            continue  # only kernels on the device's streams, not the XLA op lines above them
        kind = "collective" if COLLECTIVE_KERNEL.search(e.get("name", "")) else "other"
        times[kind] += float(e.get("dur", 0)) / 1e3  # us -> ms
    return dict(times) or None


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="steps traced")
    parser.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--trace-dir", default="tp_trace")
    parser.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> dict:
    import jax
    from jaxllm.benchmarks.latency import compile_decode_step
    from jaxllm.benchmarks.provenance import source_commit

    import jaxllm
    from jaxllm.engine.engine_config import resolve_unroll_layers

    unroll = resolve_unroll_layers(args.unroll_layers, jax.default_backend())
    model = jaxllm.load_model(args.model, dtype=args.dtype, load_format=args.load_format,
                              unroll_layers=unroll,
                              tensor_parallel_size=args.tensor_parallel_size)
    step, pool, batch = compile_decode_step(model, args.batch_size, args.context_len,
                                            backend=args.attention_backend)
    counts = collective_counts(step.as_text())
    for _ in range(3):
        tokens, pool = step(model.params, pool, batch)
    jax.block_until_ready(tokens)
    start = time.perf_counter()
    with jax.profiler.trace(args.trace_dir, create_perfetto_trace=True):
        for _ in range(args.steps):
            tokens, pool = step(model.params, pool, batch)
        jax.block_until_ready(tokens)
    step_ms = 1e3 * (time.perf_counter() - start) / args.steps  # traced: slower than untraced
    kernels = device_kernel_times(args.trace_dir)
    per_step = {k: v / args.steps for k, v in (kernels or {}).items()}
    total = sum(per_step.values())
    print(f"{model.name} TP={args.tensor_parallel_size} batch {args.batch_size} context "
          f"{args.context_len}: {model.config.num_hidden_layers} layers; collectives in the "
          f"step: {', '.join(f'{n} {k}' for k, n in counts.items() if n) or 'none'}")
    if per_step:
        print(f"device kernels per step {total:.3f} ms: collectives "
              f"{per_step.get('collective', 0):.3f} ms "
              f"({100 * per_step.get('collective', 0) / total:.1f}%), other "
              f"{per_step.get('other', 0):.3f} ms; traced step {step_ms:.3f} ms")
    else:
        print(f"no device kernels in the trace (platform {jax.default_backend()}); traced step "
              f"{step_ms:.3f} ms")
    result = {"commit": source_commit(), "model": model.name, "dtype": model.dtype.name,
              "device": jax.devices()[0].device_kind,
              "tensor_parallel_size": args.tensor_parallel_size,
              "batch_size": args.batch_size, "context_len": args.context_len,
              "collectives": counts, "kernel_ms_per_step": per_step,
              "traced_step_ms": step_ms, "trace_dir": os.path.abspath(args.trace_dir)}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxllm.benchmarks.tp_profile",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
