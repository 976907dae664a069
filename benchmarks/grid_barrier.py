"""``python -m jaxllm.benchmarks.grid_barrier``: what a grid-wide barrier inside one Pallas
kernel costs against a kernel boundary, and whether loads issued before it hide the next
phase's first memory latency (GPU only).

The one-row AWQ decode step is ~13 kernels a layer whose small GEMVs are bound by their own
ramp and tail (RESULTS.md, H100, 2026-12-06: 4.3 us for o even with its weight in L2), so
fewer kernel boundaries looked like its 2.5x goal's path: a persistent kernel running a
layer's phases with grid barriers between them (``pallas_kernels/grid_barrier.py``). This
measures that primitive before any kernel is built on it (on an H100, 2026-12-07: the barrier
lost to the kernel boundary at these phase sizes, RESULTS.md). Every variant streams the same
data, ``--phase-mb`` a phase (by default the Llama-3-8B AWQ layer's four weights: qkv, o,
gate_up, down) for ``--layers`` layers, over one program per SM (4 warps, 16 KB a step a
program, the next step's tile loaded while this one is added)::

    kernels     one pallas_call a phase; phase i adds what program p + 1 wrote in phase
                i - 1 (read through the previous call's output): XLA's kernel boundary
    barrier     one pallas_call for all phases, a grid barrier between them, the same reads
    prefetch    as barrier, each program loading its first tile of the next phase before
                it arrives at the barrier
    unsynced    one pallas_call, no barrier and no read across programs: the streaming floor

Each variant's result is checked against XLA's on the device (int32 sums: exact), then timed
back to back and by device time (a profiler trace). Per boundary: (variant - unsynced) /
(phases - 1).

    python -m jaxllm.benchmarks.grid_barrier --layers 4 --output-json barrier.json
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxllm.pallas_kernels.grid_barrier import INTERPRET_REFUSAL, grid_barrier

TILE = (16, 256)  # i32 words a step a program: 16 KB, 8 16-byte loads a thread at 4 warps
NUM_WARPS = 4
MODES = ("kernels", "barrier", "prefetch", "unsynced")
LAYER_MB = "12.6,8.4,58.7,29.4"  # Llama-3-8B AWQ: qkv, o, gate_up, down (int4 words)


def _stream(data_ref, phase: int, program, steps: int, first=None):
    """Sum of ``program``'s tiles of ``phase`` (data [phases, P, steps, S, C]) over the steps
    and the tile's rows, i32[C]; each step's add waits on the tile loaded one step before
    (``first``: step 0's, already loaded)."""
    tile = data_ref[phase, program, 0] if first is None else first

    def step(i, carry):
        acc, current = carry
        ahead = data_ref[phase, program, jnp.minimum(i + 1, steps - 1)]
        return acc + current, ahead

    acc, _ = jax.lax.fori_loop(0, steps, step, (jnp.zeros(TILE, jnp.int32), tile))
    return acc.sum(axis=0)


def _fused_kernel(data_ref, _count_in, out_ref, count_ref, ok_ref, *, mode: str, steps: tuple):
    """All phases in one program: out[i, p] = sums[i, p] (+ out[i - 1, p + 1], synced)."""
    p, programs = pl.program_id(0), pl.num_programs(0)
    ok = jnp.bool_(True)
    first = None
    for phase, phase_steps in enumerate(steps):
        total = _stream(data_ref, phase, p, phase_steps, first)
        first = None
        if phase > 0 and mode != "unsynced":
            total = total + out_ref[phase - 1, (p + 1) % programs]
        out_ref[phase, p] = total
        if phase + 1 < len(steps) and mode != "unsynced":
            if mode == "prefetch":
                first = data_ref[phase + 1, p, 0]
            ok = ok & grid_barrier(count_ref, (phase + 1) * programs)
    ok_ref[p] = ok.astype(jnp.int32)


def _phase_kernel(data_ref, prev_ref, out_ref, *, phase: int, steps: int):
    p, programs = pl.program_id(0), pl.num_programs(0)
    total = _stream(data_ref, phase, p, steps)
    if phase > 0:
        total = total + prev_ref[(p + 1) % programs]
    out_ref[p] = total


def _whole(shape):
    return pl.BlockSpec(shape, lambda p: (0,) * len(shape))


def _params():
    return pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


def phases_program(mode: str, steps: tuple, programs: int, interpret: bool = False):
    """A jitted ``f(data) -> (out i32[phases, P, C], ok i32[P])``: ``mode``'s chain over data
    i32[phases, P, max(steps), S, C] (phase i reads ``steps[i]`` steps)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    phases, cols = len(steps), TILE[1]

    def chained(data):
        prev = jnp.zeros((programs, cols), jnp.int32)
        outs = []
        for phase, phase_steps in enumerate(steps):
            prev = pl.pallas_call(
                functools.partial(_phase_kernel, phase=phase, steps=phase_steps),
                grid=(programs,), in_specs=[_whole(data.shape), _whole(prev.shape)],
                out_specs=_whole(prev.shape),
                out_shape=jax.ShapeDtypeStruct(prev.shape, jnp.int32),
                compiler_params=_params(), interpret=interpret, name=f"phase{phase}",
            )(data, prev)
            outs.append(prev)
        return jnp.stack(outs), jnp.ones((programs,), jnp.int32)

    def fused(data):
        count = jnp.zeros((1,), jnp.int32)
        out, _, ok = pl.pallas_call(
            functools.partial(_fused_kernel, mode=mode, steps=steps),
            grid=(programs,), in_specs=[_whole(data.shape), _whole(count.shape)],
            out_specs=[_whole((phases, programs, cols)), _whole((1,)), _whole((programs,))],
            out_shape=[jax.ShapeDtypeStruct((phases, programs, cols), jnp.int32),
                       jax.ShapeDtypeStruct((1,), jnp.int32),
                       jax.ShapeDtypeStruct((programs,), jnp.int32)],
            input_output_aliases={1: 1}, compiler_params=_params(), interpret=interpret,
            name=f"phases_{mode}",
        )(data, count)
        return out, ok

    if interpret and mode in ("barrier", "prefetch"):
        raise ValueError(INTERPRET_REFUSAL)
    return jax.jit(chained if mode == "kernels" else fused)


def reference(data, steps: tuple, synced: bool):
    """XLA's out [phases, P, C]: each phase's tile sums, plus (``synced``) the previous
    phase's out of the next program."""
    outs, prev = [], None
    for phase, phase_steps in enumerate(steps):
        total = data[phase, :, :phase_steps].sum(axis=(1, 2), dtype=jnp.int32)
        if synced and prev is not None:
            total = total + jnp.roll(prev, -1, axis=0)
        outs.append(total)
        prev = total
    return jnp.stack(outs)


def phase_steps(phase_mb: list[float], layers: int, programs: int) -> tuple:
    """Steps a program a phase: each phase's megabytes over the programs' 16 KB tiles."""
    tile_bytes = TILE[0] * TILE[1] * 4
    return tuple(max(1, round(mb * 1e6 / programs / tile_bytes)) for mb in phase_mb) * layers


def _back_to_back_us(fn, data, iters: int) -> float:
    jax.block_until_ready(fn(data))
    start = time.perf_counter()
    jax.block_until_ready([fn(data) for _ in range(iters)])
    return (time.perf_counter() - start) / iters * 1e6


def run(args) -> dict:
    from jaxllm.benchmarks.latency import traced_calls
    from jaxllm.benchmarks.provenance import source_commit, write_json

    if jax.default_backend() != "gpu":
        raise SystemExit("grid_barrier times GPU kernels: it needs a GPU")
    device = jax.devices()[0]
    programs = args.programs or device.core_count
    steps = phase_steps([float(m) for m in args.phase_mb.split(",")], args.layers, programs)
    data = jax.random.randint(jax.random.key(0), (len(steps), programs, max(steps), *TILE),
                              -1000, 1000, jnp.int32)
    total_mb = sum(s * programs * TILE[0] * TILE[1] * 4 for s in steps) / 1e6
    result = {"device": device.device_kind, "commit": source_commit(), "programs": programs,
              "steps": list(steps), "total_mb": total_mb, "rows": []}
    print(f"{programs} programs, {len(steps)} phases, {total_mb:.1f} MB; steps {steps}")
    print(f"{'mode':<10}{'correct':>8}{'b2b us':>10}{'device us':>11}{'kernels':>9}"
          f"{'GB/s':>8}{'us/boundary':>13}", flush=True)
    floor = None
    for mode in ["unsynced"] + [m for m in MODES if m != "unsynced"]:
        fn = phases_program(mode, steps, programs)
        out, ok = jax.block_until_ready(fn(data))
        expected = reference(data, steps, synced=mode != "unsynced")
        correct = bool(jnp.all(out == expected)) and bool(jnp.all(ok == 1))
        b2b = _back_to_back_us(fn, data, args.iters)
        trace = traced_calls(fn, (data,), args.reps, top=1000)
        busy = trace["busy_ms"] * 1e3 / args.reps
        launches = sum(k["count"] for k in trace["kernels"]) / args.reps
        floor = b2b if mode == "unsynced" else floor
        row = {"mode": mode, "correct": correct, "b2b_us": b2b, "device_us": busy,
               "kernels_a_call": launches, "gb_s": total_mb * 1e3 / b2b,
               "us_per_boundary": (b2b - floor) / max(1, len(steps) - 1)}
        result["rows"].append(row)
        print(f"{mode:<10}{str(correct):>8}{b2b:>10.1f}{busy:>11.1f}{launches:>9.0f}"
              f"{row['gb_s']:>8.0f}{row['us_per_boundary']:>13.2f}", flush=True)
        write_json(result, args.output_json)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-mb", default=LAYER_MB,
                        help="megabytes each phase of a layer streams (comma-separated)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--programs", type=int, default=0,
                        help="programs in the grid (default: the GPU's SMs)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--output-json", default=None)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
