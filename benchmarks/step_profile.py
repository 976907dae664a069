"""Where an engine step's time goes: a device trace and a host profile of one offline run.

Runs ``bench throughput``'s jaxllm workload twice on one engine. The first pass is timed as
``bench throughput`` times it; the second traces a window of steps with ``jax.profiler``
(device kernels and executables, no Python tracer) and profiles another window's host
Python with cProfile. Prints, for the traced window:

- device busy time (the union of kernel intervals on every stream) against the window's
  wall span, so idle device time shows as the gap between them;
- each executable's device time (forward, sampler, ...), and a least-squares fit of the
  forward's device time against the step's padded token count (fixed + per-token cost);
- the kernels with the most device time, grouped by kernel name;
- the host functions with the most time (cProfile: relative, its overhead inflates Python).

    python -m jaxllm.benchmarks.step_profile --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 --dataset-name sharegpt-like --num-prompts 1000 \\
        --max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 48000 \\
        --unroll-layers --trace-steps 300:150 --host-profile-steps 600:150 --out-dir /tmp/prof
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import glob
import io
import json
import os
import pstats
import re
import time

import numpy as np

PHASES = ("schedule_seconds", "prepare_seconds", "update_seconds", "output_seconds",
          "device_wait_seconds", "bitmask_seconds", "bitmask_fill_seconds")


def _window(text: str) -> tuple[int, int]:
    start, count = (int(x) for x in text.split(":"))
    if start < 0 or count < 1:
        raise argparse.ArgumentTypeError(f"{text}: want START:COUNT with COUNT >= 1")
    return start, count


def add_args(parser: argparse.ArgumentParser) -> None:
    from jaxllm.benchmarks.throughput import add_args as throughput_args

    throughput_args(parser)
    parser.add_argument("--trace-steps", type=_window, default=(300, 150),
                        help="START:COUNT steps of the second pass traced with jax.profiler")
    parser.add_argument("--host-profile-steps", type=_window, default=(600, 150),
                        help="START:COUNT steps of the second pass profiled with cProfile")
    parser.add_argument("--out-dir", default="step_profile")
    parser.add_argument("--top", type=int, default=25, help="rows in each printed table")


def _busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """The union's length and the idle gaps between its pieces (ns)."""
    busy, end, gaps = 0.0, None, []
    for s, e in sorted(intervals):
        if end is None or e > end:
            if end is not None and s > end:
                gaps.append(s - end)
            busy += e - (s if end is None else max(s, end))
            end = e
    return busy, gaps


def _kernel_group(name: str) -> str:
    """Kernels of the unrolled layers differ only by numeric suffixes: drop them."""
    return re.sub(r"(_\d+)+$|\.\d+$", "", name)[:90]


def summarize_trace(path: str, steps: list[dict], top: int) -> dict:
    """Device-side figures of one ``xplane.pb`` (see the module docstring)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    kernels, modules, lines = [], [], collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            lines[line.name] += 1
            if line.name == "XLA Modules":
                modules += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
            elif line.name.startswith("Stream"):
                kernels += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    if not kernels:
        return {"error": f"no device kernels in {path}"}
    span_ns = max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)
    busy_ns, idle = _busy_and_gaps([(s, s + d) for _, s, d in kernels])
    idle_ms = np.array(idle) / 1e6
    long_idle = idle_ms[idle_ms >= 0.05]
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    for name, _, d in kernels:
        group = by_kernel[_kernel_group(name)]
        group[0] += 1
        group[1] += d
    by_module = collections.defaultdict(lambda: [0, 0.0])
    for name, _, d in modules:
        group = by_module[re.sub(r"\(\d+\)$", "", name)]
        group[0] += 1
        group[1] += d
    forward = sorted((m for m in modules if "forward" in m[0]), key=lambda m: m[1])
    fit = None
    if forward and len(forward) == len(steps):
        tokens = np.array([s["bucket_tokens"] for s in steps], float)
        times = np.array([d for _, _, d in forward], float) / 1e6
        a = np.vstack([np.ones_like(tokens), tokens]).T
        (fixed, per_token), *_ = np.linalg.lstsq(a, times, rcond=None)
        fit = {"fixed_ms": fixed, "per_token_us": 1e3 * per_token,
               "mean_forward_ms": float(times.mean()),
               "mean_bucket_tokens": float(tokens.mean()),
               "mean_real_tokens": float(np.mean([s["real_tokens"] for s in steps]))}
    gaps = []
    ordered = sorted(modules, key=lambda m: m[1])
    for (_, s0, d0), (_, s1, _) in zip(ordered, ordered[1:], strict=False):
        gaps.append(max(0.0, s1 - (s0 + d0)) / 1e6)
    return {
        "trace": path, "steps": len(steps), "span_ms": span_ns / 1e6, "busy_ms": busy_ns / 1e6,
        "busy_fraction": busy_ns / span_ns, "device_lines": dict(lines),
        "idle_gaps_ms": {"count_over_50us": int(long_idle.size),
                         "total_over_50us": float(long_idle.sum()),
                         "p50_over_50us": float(np.median(long_idle)) if long_idle.size else 0,
                         "max": float(idle_ms.max()) if idle_ms.size else 0.0,
                         "total": float(idle_ms.sum())},
        "step_shapes": steps,
        "gap_between_executables_ms": {"total": float(np.sum(gaps)) if gaps else 0.0,
                                       "p50": float(np.median(gaps)) if gaps else 0.0,
                                       "max": float(np.max(gaps)) if gaps else 0.0},
        "modules": {k: {"count": c, "total_ms": t / 1e6} for k, (c, t) in
                    sorted(by_module.items(), key=lambda kv: -kv[1][1])},
        "forward_fit": fit,
        "kernels": [{"kernel": k, "count": c, "total_ms": t / 1e6, "share": t / busy_ns}
                    for k, (c, t) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]],
    }


def _step_info(engine) -> dict | None:
    inflight = engine._inflight
    if inflight is None:
        return None
    out, pending, _ = inflight
    return {"real_tokens": out.num_batched_tokens, "bucket_tokens": pending.shape.num_tokens,
            "rows": pending.shape.num_seqs, "decode": pending.shape.is_decode}


def run(args) -> None:
    import jax
    from jaxllm.benchmarks.jax_backends import add_workload, make_engine
    from jaxllm.benchmarks.throughput import _requests, load_tokenizer_file

    import jaxllm
    from jaxllm.engine.engine_config import resolve_unroll_layers

    os.makedirs(args.out_dir, exist_ok=True)
    model = jaxllm.load_model(
        args.model, dtype=args.dtype, load_format=args.load_format, seed=args.seed,
        unroll_layers=resolve_unroll_layers(args.unroll_layers, jax.default_backend()))
    if args.tokenizer:
        model = dataclasses.replace(model, tokenizer=load_tokenizer_file(
            args.tokenizer, model.config.eos_token_ids))
    requests = _requests(args, model.config)
    engine = make_engine(model, args)
    result: dict = {"args": {k: v for k, v in vars(args).items()
                             if isinstance(v, (int, float, str, bool, type(None), tuple))}}

    # Pass 1: timed as bench throughput times it.
    steps_before = engine.stats.num_steps
    start = time.perf_counter()
    add_workload(engine, requests, args, tag="a")
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(c.token_ids) for o in engine.step() if o.finished
                        for c in o.outputs)
    elapsed = time.perf_counter() - start
    phases = {p: 1e3 * getattr(engine.stats, p) for p in PHASES}
    result["timed"] = {"output_tokens": produced, "seconds": elapsed,
                       "output_tokens_per_s": produced / elapsed,
                       "steps": engine.stats.num_steps - steps_before,
                       "host_ms_per_step": {p.removesuffix("_seconds"): round(
                           v / max(1, engine.stats.num_steps - steps_before), 3)
                           for p, v in phases.items()}}
    print(f"pass 1: {produced} output tokens in {elapsed:.2f} s = "
          f"{produced / elapsed:,.0f} tok/s, {result['timed']['steps']} steps, host ms a step "
          f"{result['timed']['host_ms_per_step']}", flush=True)

    # Pass 2: the same workload with a traced window and a host-profiled window.
    add_workload(engine, requests, args, tag="b")
    trace_start, trace_count = args.trace_steps
    host_start, host_count = args.host_profile_steps
    trace_dir = os.path.join(args.out_dir, "trace")
    profiler = cProfile.Profile()
    traced: list[dict] = []
    step, tracing, hosting = 0, False, False
    while engine.has_unfinished_requests():
        if step == trace_start:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            jax.profiler.start_trace(trace_dir, profiler_options=options)
            tracing = True
        if step == host_start:
            profiler.enable()
            hosting = True
        engine.step()
        if tracing:
            info = _step_info(engine)
            if info is not None:
                traced.append(info)
        step += 1
        if tracing and step == trace_start + trace_count:
            jax.block_until_ready(engine.runner.kv_pool)
            jax.profiler.stop_trace()
            tracing = False
        if hosting and step == host_start + host_count:
            profiler.disable()
            hosting = False
    if tracing:
        jax.block_until_ready(engine.runner.kv_pool)
        jax.profiler.stop_trace()
    if hosting:
        profiler.disable()

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    result["device"] = summarize_trace(paths[-1], traced, args.top) if paths else {
        "error": "no trace written (the run had fewer steps than --trace-steps' start)"}
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    with open(os.path.join(args.out_dir, "host_profile.txt"), "w") as f:
        f.write(text.getvalue())
    with open(os.path.join(args.out_dir, "step_profile.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    _print(result, text.getvalue())


def _print(result: dict, host: str) -> None:
    dev = result["device"]
    if "error" in dev:
        print(dev["error"])
    else:
        print(f"\ntraced {dev['steps']} steps: span {dev['span_ms']:.1f} ms, device busy "
              f"{dev['busy_ms']:.1f} ms ({100 * dev['busy_fraction']:.1f}%); idle gaps "
              f"{dev['idle_gaps_ms']}")
        shapes = dev["step_shapes"]
        if shapes:
            print(f"  per step: {np.mean([s['real_tokens'] for s in shapes]):.0f} real tokens, "
                  f"{np.mean([s['bucket_tokens'] for s in shapes]):.0f} bucket tokens, "
                  f"{np.mean([s['rows'] for s in shapes]):.0f} rows, "
                  f"{np.mean([s['decode'] for s in shapes]):.0%} decode-only")
        for name, m in dev["modules"].items():
            print(f"  {name[:60]:60s} x{m['count']:5d} {m['total_ms']:9.1f} ms")
        if dev["forward_fit"]:
            print("  forward fit:", {k: round(v, 3) for k, v in dev["forward_fit"].items()})
        print(f"  {'kernel':90s} {'count':>6s} {'ms':>8s} share")
        for k in dev["kernels"]:
            print(f"  {k['kernel']:90s} {k['count']:6d} {k['total_ms']:8.1f} "
                  f"{100 * k['share']:4.1f}%")
    print("\nhost (cProfile, by own time):")
    print("\n".join(host.splitlines()[:45]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
