"""Where a Hopper prefill call's time goes (issue 17's prefill goal), on the GPU.

For each point (a chunk of new tokens over cached ones, Llama-3-8B heads, as ``kernels.py
--acceptance`` builds it) one program of N calls of ``paged_attention_prefill_hopper`` is seen
three ways:

1. timed as k1 times it (``kernels.py --dispatch-included``; k1 makes N 32, this N 8 unless
   ``--calls`` says otherwise): the program's wall over N;
2. a device trace (``jax.profiler``): each kernel's device time a call, so the Mosaic kernel's
   own time (and TFLOP/s) apart from what XLA runs around it (the block plan, once a program;
   q's padding before ``a904c45``), and the device's idle time before each kernel group;
3. the kernel's own profile (Mosaic GPU's on-device profiler over the kernel's named scopes),
   for a config that leaves shared memory for it: per warpgroup role, the share of a program's
   span in each scope (waits on K / V / q, the products, softmax, epilogue), and the spread of
   the programs' starts and ends (the call's ramp and tail).

    python -m jaxllm.benchmarks.prefill_anatomy --points 2048:0,2048:2048,2048:8192 \\
        --out-dir /tmp/anatomy
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import statistics
import time

import jax
import numpy as np
from jaxllm.benchmarks.kernels import ceilings, pseudo_random, run_timed
from jaxllm.benchmarks.kernels_prefill import prefill_call, prefill_problem
from jaxllm.benchmarks.step_profile import summarize_trace
from jaxllm.pallas_kernels.paged_attention.prefill_hopper import paged_attention_prefill_hopper
from jaxllm.pallas_kernels.paged_attention.prefill_hopper_config import HopperPrefillConfig
from jaxllm.pallas_kernels.paged_attention.shapes import HEAD_SHAPES

HEADS = "llama3_8b"
BLOCK = 16
# Shared memory for the profiler's buffer: 2 K + 2 V slots leave 35 KiB of the 227.
PROFILED = HopperPrefillConfig(max_concurrent_steps=2, v_concurrent_steps=2, prefetch_q=True)
ROLES = {0: "compute", 1: "compute", 2: "memory"}
CLOCK_GHZ = 1.98  # the H200's SM clock under load (nvidia-smi's max); cycles -> us only


def _program(p: dict, config: HopperPrefillConfig, num_calls: int, profile=None):
    call = prefill_call(functools.partial(paged_attention_prefill_hopper, config=config,
                                          profile=profile), p, HEAD_SHAPES[HEADS].head_dim ** -0.5)
    return jax.jit(lambda q_all, k, v: [call(i, q_all, k, v) for i in range(num_calls)])


def device_view(program, args, trace_dir: str, num_calls: int, flops: float) -> dict:
    """Each kernel group's device time a call, from one traced run of ``program``."""
    jax.block_until_ready(program(*args))
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready(program(*args))
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    summary = summarize_trace(path, [], top=30)
    kernels = [{"kernel": k["kernel"], "per_call": k["count"] / num_calls,
                "us_a_call": 1e3 * k["total_ms"] / num_calls,
                "idle_before_us_a_call": 1e3 * k["idle_before_ms"] / num_calls}
               for k in summary["kernels"]]
    mosaic_us = sum(k["us_a_call"] for k in kernels if "mosaic" in k["kernel"])
    return {"span_us_a_call": 1e3 * summary["span_ms"] / num_calls,
            "busy_us_a_call": 1e3 * summary["busy_ms"] / num_calls,
            "kernel_us": mosaic_us,
            "kernel_TFLOPs": flops / (mosaic_us * 1e-6) / 1e12 if mosaic_us else None,
            "kernels": kernels}


def summarize_kernel_profile(path: str) -> dict:
    """One on-device profile (Mosaic GPU's Chrome-trace JSON): a trace per warpgroup of each
    program, timestamps in SM clock cycles within a trace (the first event's at the program's
    global start, in ns)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    by_trace = collections.defaultdict(list)
    for e in events:
        by_trace[e["tid"]].append(e)
    per_role = collections.defaultdict(lambda: collections.defaultdict(list))
    spans = collections.defaultdict(list)
    starts, ends = [], []
    for tid, evs in by_trace.items():
        role = ROLES[(tid - 1) % 3]
        open_at, totals, counts = {}, collections.Counter(), collections.Counter()
        for e in evs:
            if e["ph"] == "B":
                open_at[e["name"]] = e["ts"]
            elif e["name"] in open_at:
                totals[e["name"]] += (e["ts"] - open_at.pop(e["name"])) * 1e3  # cycles
                counts[e["name"]] += 1
        span = (evs[-1]["ts"] - evs[0]["ts"]) * 1e3
        spans[role].append(span)
        for name in totals:
            per_role[role][name].append((totals[name], counts[name], span))
        if role == "compute":
            starts.append(evs[0]["ts"])  # us of the global timer: where the program began
            ends.append(evs[0]["ts"] + span / 1e3 / CLOCK_GHZ)
    out = {"programs": len(by_trace) // 3, "clock_GHz_assumed": CLOCK_GHZ}
    for role, names in per_role.items():
        out[role] = {
            "mean_span_cycles": statistics.mean(spans[role]),
            "scopes": {name: {"share": sum(t for t, _, _ in rows) / sum(s for _, _, s in rows),
                              "mean_count": statistics.mean(c for _, c, _ in rows),
                              "mean_cycles_each": sum(t for t, _, _ in rows)
                              / max(sum(c for _, c, _ in rows), 1)}
                       for name, rows in sorted(names.items())}}
    if starts:
        first = min(starts)
        out["program_start_us"] = _spread(np.array(starts) - first)
        out["program_end_us"] = _spread(np.array(ends) - first)
    return out


def _spread(x: np.ndarray) -> dict:
    return {"min": float(x.min()), "p50": float(np.median(x)), "max": float(x.max())}


def kernel_profile(p: dict, args, out_dir: str, space: int) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    before = set(glob.glob(os.path.join(out_dir, "*-trace.json")))
    jax.block_until_ready(_program(p, PROFILED, 1, profile=(out_dir, space))(*args))
    new = sorted(set(glob.glob(os.path.join(out_dir, "*-trace.json"))) - before)
    if not new:
        return {"error": f"no profile written to {out_dir}"}
    return summarize_kernel_profile(new[-1])


def one_point(chunk: int, cached: int, num_calls: int, out_dir: str, space: int | None) -> dict:
    h = HEAD_SHAPES[HEADS]
    p = prefill_problem(chunk, cached, HEADS, block=BLOCK, pseudo_random=pseudo_random)
    q_all = pseudo_random((num_calls, chunk, h.num_q_heads, h.head_dim), 4.5)
    args = (q_all, p["k"], p["v"])
    row = {"chunk": chunk, "cached": cached, "GFLOP": p["flops"] / 1e9, "calls": num_calls}
    for name, config in (("default", HopperPrefillConfig()), ("profiled_config", PROFILED)):
        program = _program(p, config, num_calls)
        sec = run_timed(program, args) / num_calls
        row[name] = {"us": sec * 1e6, "TFLOPs": p["flops"] / sec / 1e12}
        if name == "default":
            row[name]["device"] = device_view(program, args,
                                              os.path.join(out_dir, f"trace_{chunk}_{cached}"),
                                              num_calls, p["flops"])
    if space:
        row["kernel_profile"] = kernel_profile(
            p, (q_all[:1], p["k"], p["v"]), os.path.join(out_dir, f"profile_{chunk}_{cached}"),
            space)
    return row


def print_row(r: dict, matmul: float) -> None:
    d = r["default"]
    dev = d["device"]
    kernel = dev["kernel_TFLOPs"] or 0
    print(f"\nchunk {r['chunk']} over {r['cached']} cached ({r['GFLOP']:.1f} GFLOP): "
          f"timed {d['us']:.1f} us a call ({d['TFLOPs']:.0f} TFLOP/s, "
          f"{100 * d['TFLOPs'] / matmul:.0f}% of matmul); device span "
          f"{dev['span_us_a_call']:.1f} us, busy {dev['busy_us_a_call']:.1f}; the Mosaic "
          f"kernel {dev['kernel_us']:.1f} us ({kernel:.0f} TFLOP/s, "
          f"{100 * kernel / matmul:.0f}%); profiled config {r['profiled_config']['us']:.1f} us")
    for k in dev["kernels"][:8]:
        print(f"  {k['us_a_call']:8.1f} us  x{k['per_call']:.2f}  idle before "
              f"{k['idle_before_us_a_call']:6.1f} us  {k['kernel']}")
    prof = r.get("kernel_profile", {"error": "not taken (--no-kernel-profile)"})
    if "error" in prof:
        print("  kernel profile:", prof["error"])
        return
    print(f"  kernel profile ({prof['programs']} programs): start us {prof['program_start_us']}"
          f", end us (at {CLOCK_GHZ} GHz) {prof['program_end_us']}")
    for role in ("compute", "memory"):
        if role not in prof:
            continue
        cells = ", ".join(f"{n} {100 * s['share']:.1f}% ({s['mean_count']:.0f} x "
                          f"{s['mean_cycles_each']:.0f} cyc)"
                          for n, s in sorted(prof[role]["scopes"].items(),
                                             key=lambda kv: -kv[1]["share"]))
        print(f"  {role} ({prof[role]['mean_span_cycles']:.0f} cycles a program): {cells}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", default="2048:0,2048:2048,2048:8192",
                        help="CHUNK:CACHED,... (issue 17's: 2k chunks over 0 / 2k / 8k)")
    parser.add_argument("--calls", type=int, default=8, help="calls in the timed program")
    parser.add_argument("--profile-space", type=int, default=600,
                        help="scope ranges a warpgroup's profile holds (later ones dropped)")
    parser.add_argument("--no-kernel-profile", action="store_true")
    parser.add_argument("--out-dir", default="prefill_anatomy")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    rows = []
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "commit": os.environ.get("JAXLLM_COMMIT"), "profiled_config": repr(PROFILED),
              "ceilings": ceilings(), "rows": rows}
    matmul = result["ceilings"]["matmul_TFLOPs"]
    print(f"matmul {matmul:.0f} TFLOP/s", flush=True)
    start = time.time()
    for point in args.points.split(","):
        chunk, cached = (int(x) for x in point.split(":"))
        try:
            rows.append(one_point(chunk, cached, args.calls, args.out_dir,
                                  None if args.no_kernel_profile else args.profile_space))
            print_row(rows[-1], matmul)
        except Exception as e:  # noqa: BLE001 - recorded, the next point runs
            rows.append({"chunk": chunk, "cached": cached,
                         "error": f"{type(e).__name__}: {str(e)[:400]}"})
            print(rows[-1], flush=True)
        with open(os.path.join(args.out_dir, "prefill_anatomy.json"), "w") as f:
            json.dump(result | {"wall_s": time.time() - start}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
