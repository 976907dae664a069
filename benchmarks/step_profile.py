"""Where an engine step's time goes: a device trace and a host profile of one offline run.

Runs ``bench throughput``'s jaxllm workload twice on one engine. The first pass is timed as
``bench throughput`` times it; the second traces a window of steps with ``jax.profiler``
(device kernels and copies, no Python tracer) and profiles another window's host Python with
cProfile. Prints, for the traced window:

- device busy time (the union of kernel and copy intervals on every stream) against the
  window's wall span, and the idle gaps between them;
- the steps' mean shapes (real and padded tokens, rows, share of decode-only steps);
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
    parser.add_argument("--sequence", default=None, metavar="REGEX",
                        help="kernels whose name matches: their durations by position within a "
                        "traced step (median over the steps), e.g. 'gemv|gemm' gives each "
                        "projection of each layer of a decode step apart")
    add_gemv_overrides_argument(parser)


def add_gemv_overrides_argument(parser) -> None:
    """``--gemv-overrides`` (read by :func:`override_gemv`), as every engine benchmark takes it."""
    parser.add_argument("--gemv-overrides", default=None,
                        help="Int4GemvConfig fields put over every config the int4 GEMV picks "
                        "(not the dot configs), e.g. 'splits_sum=last,x_in_kernel=True', or "
                        "'table=NAME' (int4_configs' candidate tables), 'nk.FIELD=..' for the "
                        "N-major GEMV: an A/B of GEMV modes inside the engine")


def override_gemv(text: str) -> str:
    """Makes the int4 GEMV put ``text``'s fields over every (non-dot) config it picks (with
    ``table=NAME``, int4_configs' candidate table NAME's config where it lists the shape), and
    the GEMV over the N-major weight (gemv_nk.py) its ``nk.FIELD`` ones; returns a
    compile-cache directory for these programs (the engine's executable cache keys on the
    model and engine, not on a patched kernel config)."""
    import dataclasses

    from jaxllm.benchmarks.int4_configs import GEMV_CANDIDATE_TABLES
    from jaxllm.benchmarks.kernel_sass import config_fields
    from jaxllm.pallas_kernels.quantized_matmul import gemv, gemv_nk

    fields = config_fields(text)
    nk_fields = {name[3:]: fields.pop(name) for name in list(fields) if name.startswith("nk.")}
    if nk_fields:
        nk_pick = gemv_nk.nk_gemv_config
        gemv_nk.nk_gemv_config = lambda m: dataclasses.replace(nk_pick(m), **nk_fields)
    name = fields.pop("table", None)
    if name is not None and name not in GEMV_CANDIDATE_TABLES:
        raise SystemExit(f"--gemv-overrides: no candidate table {name!r} "
                         f"(int4_configs.GEMV_CANDIDATE_TABLES: {sorted(GEMV_CANDIDATE_TABLES)})")
    table = GEMV_CANDIDATE_TABLES.get(name, {})
    pick = gemv.gemv_config

    def patched(m: int, k: int, n: int, group_size: int):
        listed = table.get((1 << max(0, m - 1).bit_length(), k, n))
        config = gemv.Int4GemvConfig(**listed) if listed else pick(m, k, n, group_size)
        return config if config.dot else dataclasses.replace(config, **fields)

    gemv.gemv_config = patched
    tag = re.sub(r"[^A-Za-z0-9_]+", "-", text).strip("-")
    return os.path.join(os.path.expanduser("~"), ".cache", "jaxllm", f"xla-gemv-{tag}")


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


def step_sequence(kernels: list[tuple[str, int, int]], steps: int, pattern: str,
                  layers: int | None = None) -> dict:
    """The kernels matching ``pattern`` in launch order, split into ``steps`` equal runs (the
    traced steps, all of one shape): each position's median duration (us) and name. With
    ``layers`` (the model's), when the step's run is that many repeats of one layer's kernels
    (before or after the few outside them): each position of a layer, its median over the
    layers and its ms a step (``by_layer``), and the kernels outside the layers."""
    picked = [(name, d) for name, _, d in sorted(kernels, key=lambda k: k[1])
              if re.search(pattern, name)]
    if not steps or not picked or len(picked) % steps:
        return {"error": f"{len(picked)} kernels matching {pattern!r} over {steps} steps"}
    per_step = len(picked) // steps
    durations = np.array([d for _, d in picked], dtype=float).reshape(steps, per_step)
    names = [_kernel_group(name) for name, _ in picked[:per_step]]
    medians = np.median(durations, axis=0) / 1e3
    result = {"pattern": pattern, "per_step": per_step, "names": names,
              "median_us": [round(float(x), 2) for x in medians]}
    period = per_step // layers if layers else 0
    for first in (0, per_step - period * layers) if period else ():
        inside = range(first, first + period * layers)
        if all(names[i].rstrip("_") == names[first + (i - first) % period].rstrip("_")
               for i in inside):
            by_position = medians[first:first + period * layers].reshape(layers, period)
            result["by_layer"] = [
                {"name": names[first + j],
                 "median_us": round(float(np.median(by_position[:, j])), 2),
                 "ms_a_step": round(float(by_position[:, j].sum()) / 1e3, 3)}
                for j in range(period)]
            result["outside_layers"] = [{"name": names[i], "median_us": round(float(medians[i]), 2)}
                                        for i in range(per_step) if i not in inside]
            break
    return result


def summarize_trace(path: str, steps: list[dict], top: int, sequence: str | None = None,
                    layers: int | None = None) -> dict:
    """Device-side figures of one ``xplane.pb`` (see the module docstring); ``steps`` are the
    traced steps' shapes (``_step_info``); ``sequence``: a regex for :func:`step_sequence`
    (``layers``: the model's)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    kernels, lines = [], collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            lines[line.name] += 1
            if line.name.startswith("Stream"):  # kernels and copies, one line per stream
                kernels += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    if not kernels:
        return {"error": f"no device kernels in {path}"}
    span_ns = max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)
    busy_ns, idle = _busy_and_gaps([(s, s + d) for _, s, d in kernels])
    idle_ms = np.array(idle) / 1e6
    long_idle = idle_ms[idle_ms >= 0.05]
    by_kernel = collections.defaultdict(lambda: [0, 0.0, 0.0])  # count, ns, idle ns before
    end = None
    for name, start, d in sorted(kernels, key=lambda k: k[1]):
        group = by_kernel[_kernel_group(name)]
        group[0] += 1
        group[1] += d
        if end is not None and start > end:  # the device waited for this kernel's launch
            group[2] += start - end
        end = start + d if end is None else max(end, start + d)
    summary = {
        "trace": path, "steps": len(steps), "span_ms": span_ns / 1e6, "busy_ms": busy_ns / 1e6,
        "busy_fraction": busy_ns / span_ns, "device_lines": dict(lines),
        "idle_gaps_ms": {"count_over_50us": int(long_idle.size),
                         "total_over_50us": float(long_idle.sum()),
                         "p50_over_50us": float(np.median(long_idle)) if long_idle.size else 0,
                         "max": float(idle_ms.max()) if idle_ms.size else 0.0,
                         "total": float(idle_ms.sum())},
        "step_shapes": steps,
        "kernels": [{"kernel": k, "count": c, "total_ms": t / 1e6, "share": t / busy_ns,
                     "idle_before_ms": idle / 1e6}
                    for k, (c, t, idle) in sorted(by_kernel.items(),
                                                  key=lambda kv: -kv[1][1])[:top]],
    }
    if sequence:
        summary["sequence"] = step_sequence(
            [k for k in kernels if not k[0].startswith("Memcpy")], len(steps), sequence, layers)
    return summary


def _step_info(engine) -> dict | None:
    """The shape of the step the engine just launched (None if it launched none)."""
    launched = engine._inflight
    if launched is None:
        return None
    # A constrained step's sampler may still wait for its bitmask: its forward has the shape.
    shape = (launched.pending or launched.forward).shape
    return {"real_tokens": launched.out.num_batched_tokens, "bucket_tokens": shape.num_tokens,
            "rows": shape.num_seqs, "decode": shape.is_decode}


def run(args) -> None:
    import jax
    from jaxllm.benchmarks.jax_backends import add_workload, make_engine
    from jaxllm.benchmarks.throughput import _requests, load_jax_model

    os.makedirs(args.out_dir, exist_ok=True)
    if args.gemv_overrides:
        args.compilation_cache_dir = override_gemv(args.gemv_overrides)
    model = load_jax_model(args)
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
    result["device"] = summarize_trace(paths[-1], traced, args.top, args.sequence,
                                       model.config.num_hidden_layers) if paths else {
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
        print(f"  {'kernel':90s} {'count':>6s} {'ms':>8s} share")
        for k in dev["kernels"]:
            print(f"  {k['kernel']:90s} {k['count']:6d} {k['total_ms']:8.1f} "
                  f"{100 * k['share']:4.1f}%")
        if "sequence" in dev:
            seq = dev["sequence"]
            print(f"  sequence {seq}" if "error" in seq else
                  f"  {seq['pattern']!r}, {seq['per_step']} a step, median us by position: "
                  + " ".join(f"{n}={u}" for n, u in zip(seq["names"][:12], seq["median_us"][:12],
                                                            strict=True)))
            if "by_layer" in seq:
                print("  a layer's positions, median us over the layers (ms a step): " + ", ".join(
                    f"#{j} {p['name']} {p['median_us']} ({p['ms_a_step']})"
                    for j, p in enumerate(seq["by_layer"])) + "; outside the layers: " + ", ".join(
                    f"{p['name']} {p['median_us']}" for p in seq["outside_layers"]))
    print("\nhost (cProfile, by own time):")
    print("\n".join(host.splitlines()[:45]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
