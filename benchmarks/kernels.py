"""Paged-attention kernel benchmark (one GPU run): ceilings, decode bandwidth, prefill FLOP/s.

Usage (repo root, on the GPU machine)::

    PYTHONPATH=. python benchmarks/kernels.py --out kernels.json [--quick] [--no-sweep]

1. Ceilings measured in the same run: copy bandwidth (a 2 GiB bf16 ``x + 1``: bytes read +
   written) and a bf16 8192^3 matmul.
2. Decode (one query token per sequence) for batch 1/8/64/256 x context 512/2048/8192 x heads
   32/8 and 32/32, head dim 128, block 16, bf16: our kernel, the XLA reference and JAX's own
   deprecated Triton kernel (``jax.experimental.pallas.ops.gpu.paged_attention``, on a
   head-major copy of the pool). Bandwidth = bytes of K and V read / time.
3. Prefill (``kernels_prefill.py``): one sequence, chunks of 512 / 2048 tokens over 0 / 2k / 8k
   cached tokens, 32/8 heads: tokens/s and TFLOP/s (4 * Hq * D per valid query-key pair).

Timing: one jitted program holds N independent calls (different queries; the pool has enough
layers that a call's K/V are cold in the 60 MB L2), is run after a warm-up, and the median of
several runs, minus the dispatch time of an empty program, is divided by N.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jaxllm.benchmarks.kernels_prefill import bench_prefill_points, print_prefill_table
from jaxllm.pallas_kernels.paged_attention import (
    DecodeConfig,
    paged_attention_decode,
    paged_attention_reference,
)
from jaxllm.pallas_kernels.paged_attention.shapes import HEAD_SHAPES

warnings.filterwarnings("ignore", category=DeprecationWarning)
BLOCK = 16
DTYPE = jnp.bfloat16
L2_BYTES = 60e6


@dataclasses.dataclass
class Plan:
    batches: tuple = (1, 8, 64, 256)
    contexts: tuple = (512, 2048, 8192)
    heads: tuple = ("llama3_8b", "llama2_7b")
    sweep_points: tuple = ((64, 2048, "llama3_8b"), (64, 8192, "llama3_8b"),
                           (64, 2048, "llama2_7b"))
    prefill_points: tuple = ((2048, 0), (2048, 8192), (2048, 2048), (512, 0), (512, 2048),
                             (512, 8192))
    copy_elems: int = 1 << 30  # 2 GiB of bf16
    matmul: int = 8192
    max_calls: int = 64
    interpret: bool = False  # --smoke: tiny shapes through the Pallas interpreter (CPU)
    # False (--dispatch-included): a call's time is the whole program's wall over its N calls,
    # the launch of the program included (issue 17's "timed end to end").
    subtract_dispatch: bool = True
    # --device-time: each call's kernels' busy time from a profiler trace, not the wall
    device_time: bool = False


PLAN = Plan()
SMOKE = Plan(batches=(1, 2), contexts=(32, 64), heads=("small_gqa",),
             sweep_points=((2, 64, "small_gqa"),), prefill_points=((32, 0), (32, 48), (16, 0)),
             copy_elems=1 << 16, matmul=256, max_calls=2, interpret=True)
# Issue 17's kernel goals only: decode at batch 64 x context 2048 (Llama-3-8B heads, shuffled
# block tables) against the copy rate, prefill of 2k-token chunks over 0 / 2k / 8k cached tokens
# against the matmul rate, both measured in the same process.
ACCEPTANCE = Plan(batches=(64,), contexts=(2048,), heads=("llama3_8b",), sweep_points=(),
                  prefill_points=((2048, 0), (2048, 2048), (2048, 8192)))


def pseudo_random(shape, seed: float, dtype=DTYPE):
    """Hash of the element index in [-1, 1): fresh values made in one fused pass (no f32 copy)."""
    def make():
        x = sum(jax.lax.broadcasted_iota(jnp.float32, shape, d) * (12.9898 + 7.233 * d)
                for d in range(len(shape)))
        h = jnp.sin(x + seed) * 43758.5453
        return (2.0 * (h - jnp.floor(h)) - 1.0).astype(dtype)
    return jax.jit(make)()


def run_timed(fn, args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


_DISPATCH = None


def dispatch_time() -> float:
    global _DISPATCH
    if _DISPATCH is None:
        x = jnp.ones((8,), jnp.float32)
        _DISPATCH = run_timed(jax.jit(lambda a: a + 1), (x,), reps=20)
    return _DISPATCH


def time_per_call(call, num_calls: int, args) -> float:
    """Seconds per call of ``call(i, *args)`` (N independent calls in one program); with
    ``PLAN.device_time`` the device's busy time from a profiler trace."""
    program = jax.jit(lambda *a: [call(i, *a) for i in range(num_calls)])
    if PLAN.device_time:
        from jaxllm.benchmarks.latency import traced_busy_s

        return traced_busy_s(program, args) / num_calls
    dispatch = dispatch_time() if PLAN.subtract_dispatch else 0.0
    return max(run_timed(program, args) - dispatch, 1e-9) / num_calls


def ceilings() -> dict:
    n = PLAN.copy_elems
    out = {}
    for dtype in (jnp.bfloat16, jnp.float32):  # one elementwise pass: bytes read + written
        x = pseudo_random((n,), 0.5, dtype)
        t = max(run_timed(jax.jit(lambda a: a + 1), (x,), reps=10) - dispatch_time(), 1e-9)
        out[f"copy_{jnp.dtype(dtype).name}_TBps"] = 2 * x.nbytes / t / 1e12
        if dtype == jnp.bfloat16:  # read-only stream: a sum
            t = max(run_timed(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), (x,), reps=10)
                    - dispatch_time(), 1e-9)
            out["read_TBps"] = x.nbytes / t / 1e12
        del x
    out["copy_TBps"] = max(out["copy_bfloat16_TBps"], out["copy_float32_TBps"])
    m = PLAN.matmul
    a = pseudo_random((m, m), 1.5) * 0.02
    b = pseudo_random((m, m), 2.5) * 0.02
    mm = jax.jit(lambda a, b: jax.lax.fori_loop(0, 10, lambda _, c: (c @ b) * 8.0, a))
    tm = run_timed(mm, (a, b), reps=3) / 10
    out["matmul_TFLOPs"] = 2 * m**3 / tm / 1e12
    return out


@dataclasses.dataclass
class DecodeProblem:
    batch: int
    context: int
    heads: str

    @property
    def kv_bytes(self) -> int:
        h = HEAD_SHAPES[self.heads]
        return 2 * self.batch * self.context * h.num_kv_heads * h.head_dim * 2

    def build(self, num_layers: int):
        h = HEAD_SHAPES[self.heads]
        pages = self.context // BLOCK
        num_blocks = self.batch * pages + 1
        shape = (num_layers, num_blocks, BLOCK, h.num_kv_heads, h.head_dim)
        rng = np.random.default_rng(0)
        tables = (1 + rng.permutation(self.batch * pages)).reshape(self.batch, pages)
        k = pseudo_random(shape, 0.25)
        v = pseudo_random(shape, 0.75)
        return dict(
            k=k, v=v, tables=jnp.asarray(tables, jnp.int32),
            seq_lens=jnp.full((self.batch,), self.context, jnp.int32),
            starts=jnp.arange(self.batch + 1, dtype=jnp.int32),
            positions=jnp.full((self.batch,), self.context - 1, jnp.int32))


def calls_and_layers(kv_bytes: int, est_bw: float = 3e12,
                     max_pool_bytes: float = 40e9) -> tuple[int, int]:
    """N calls, each on its own layer of the pool: no call finds its K/V in L2, and XLA cannot
    merge the reference's gathers and dots across calls (it did when they shared a layer)."""
    num_calls = int(min(PLAN.max_calls, max(4, math.ceil(4e-3 / (kv_bytes / est_bw)))))
    num_calls = int(max(1, min(num_calls, max_pool_bytes // kv_bytes)))
    return num_calls, num_calls


def bench_decode(p: DecodeProblem, impls: dict, budget_bytes: float = 60e9,
                 with_jax: bool = True) -> dict:
    h = HEAD_SHAPES[p.heads]
    num_calls, num_layers = calls_and_layers(p.kv_bytes)
    d = p.build(num_layers)
    q_all = pseudo_random((num_calls, p.batch, h.num_q_heads, h.head_dim), 3.5)
    scale = h.head_dim ** -0.5
    result = {"batch": p.batch, "context": p.context, "heads": p.heads, "calls": num_calls,
              "layers": num_layers, "kv_bytes": p.kv_bytes}
    args = (q_all, d["k"], d["v"], d["tables"], d["seq_lens"], d["starts"], d["positions"])
    for name, fn in impls.items():
        if name == "reference" and p.kv_bytes * 2 * 2 > budget_bytes:  # f32 gathers of K, V
            result[name] = "skipped: f32 gathers would not fit"
            continue
        try:
            call = lambda i, q, k, v, t, sl, st, pos, fn=fn: fn(
                q[i], k, v, i % num_layers, t, sl, st, pos, scale=scale)
            sec = time_per_call(call, num_calls, args)
            result[name] = {"us": sec * 1e6, "TBps": p.kv_bytes / sec / 1e12}
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            result[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
    if with_jax:
        try:
            result["jax_triton"] = bench_jax_kernel(p, d, q_all, num_calls, num_layers)
        except Exception as e:  # noqa: BLE001
            result["jax_triton"] = f"error: {type(e).__name__}: {str(e)[:200]}"
    return result


def bench_jax_kernel(p, d, q_all, num_calls, num_layers):
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    num_blocks = d["k"].shape[1]
    to_head_major = jax.jit(lambda x: jnp.transpose(x, (3, 0, 1, 2, 4)).reshape(
        x.shape[3], x.shape[0] * num_blocks, BLOCK, x.shape[4]))
    k_hm, v_hm = to_head_major(d["k"]), to_head_major(d["v"])
    call = lambda i, q, k, v, t, sl: jax_pa.paged_attention(
        q[i], k, v, t + (i % num_layers) * num_blocks, sl, interpret=PLAN.interpret,
        **({"k_splits": 2} if PLAN.interpret else {}))
    sec = time_per_call(call, num_calls, (q_all, k_hm, v_hm, d["tables"], d["seq_lens"]))
    del k_hm, v_hm
    return {"us": sec * 1e6, "TBps": p.kv_bytes / sec / 1e12}


def decode_impls(configs: dict[str, DecodeConfig]) -> dict:
    impls = {name: (lambda *a, c=c, **kw: paged_attention_decode(
        *a, config=c, interpret=PLAN.interpret, **kw)) for name, c in configs.items()}
    impls["reference"] = paged_attention_reference
    return impls


def _dc(block_kv, warps, stages, splits=None):
    return DecodeConfig(block_kv=block_kv, num_warps=warps, num_stages=stages,
                        num_splits=splits)


SWEEP = {  # name: kv<block_kv>_w<warps>_s<stages>[_k<splits>]
    "kv128_w4_s2": _dc(128, 4, 2),
    "kv128_w4_s3": _dc(128, 4, 3),
    "kv128_w8_s2": _dc(128, 8, 2),
    "kv64_w4_s3": _dc(64, 4, 3),
    "kv64_w4_s4": _dc(64, 4, 4),
    "kv64_w2_s3": _dc(64, 2, 3),
    "kv256_w8_s2": _dc(256, 8, 2),
    "kv256_w4_s2": _dc(256, 4, 2),
    "kv128_w4_s2_k1": _dc(128, 4, 2, 1),
    "kv128_w4_s3_k1": _dc(128, 4, 3, 1),
    "kv128_w4_s2_k4": _dc(128, 4, 2, 4),
    "kv64_w4_s3_k1": _dc(64, 4, 3, 1),
    # one sequence (the batch-1 decode step: Llama-3-8B's 8 KV heads give 8 x splits programs,
    # at most 16 splits of 64 keys over 1,024 cached tokens): smaller key blocks, more splits
    "kv32_w4_s3_k32": _dc(32, 4, 3, 32),
    "kv32_w2_s2_k32": _dc(32, 2, 2, 32),
    "kv16_w4_s2_k64": _dc(16, 4, 2, 64),
    "kv16_w2_s2_k64": _dc(16, 2, 2, 64),
    "kv16_w1_s1_k64": _dc(16, 1, 1, 64),
    "kv32_w4_s3_k16": _dc(32, 4, 3, 16),
}


def _decode_call(i, q, k, v, t, sl, st, pos, *, num_layers, scale, config):
    return paged_attention_decode(q[i], k, v, i % num_layers, t, sl, st, pos, scale=scale,
                                  config=config, interpret=PLAN.interpret)


def sweep_decode(points, deadline) -> dict:
    out = {}
    for p in points:
        num_calls, num_layers = calls_and_layers(p.kv_bytes)
        d = p.build(num_layers)
        h = HEAD_SHAPES[p.heads]
        q_all = pseudo_random((num_calls, p.batch, h.num_q_heads, h.head_dim), 3.5)
        args = (q_all, d["k"], d["v"], d["tables"], d["seq_lens"], d["starts"], d["positions"])
        key = f"b{p.batch}_ctx{p.context}_{p.heads}"
        out[key] = {}
        for name, cfg in SWEEP.items():
            if time.time() > deadline:
                break
            call = functools.partial(_decode_call, num_layers=num_layers,
                                     scale=h.head_dim ** -0.5, config=cfg)
            try:
                sec = time_per_call(call, num_calls, args)
                out[key][name] = {"us": sec * 1e6, "TBps": p.kv_bytes / sec / 1e12}
            except Exception as e:  # noqa: BLE001
                out[key][name] = f"error: {type(e).__name__}: {str(e)[:200]}"
            print(f"  sweep {key} {name}: {out[key][name]}", flush=True)
        del d, q_all
    return out


def main() -> int:
    global PLAN
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="kernels.json")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in the Pallas interpreter: checks this script on CPU")
    parser.add_argument("--acceptance", action="store_true",
                        help="issue 17's points only (decode 64 x 2048, prefill 2k chunks)")
    parser.add_argument("--dispatch-included", action="store_true",
                        help="do not subtract an empty program's dispatch from the calls' time")
    parser.add_argument("--no-sweep", action="store_true", help="no decode config sweep")
    parser.add_argument("--no-jax", action="store_true", help="skip JAX's own Triton kernel")
    parser.add_argument("--no-prefill-sweep", action="store_true")
    parser.add_argument("--no-prefill-reference", action="store_true")
    parser.add_argument("--hopper", action="store_true",
                        help="also the Mosaic GPU prefill kernel (prefill_hopper; GPU only)")
    parser.add_argument("--no-prefill", action="store_true", help="decode only")
    parser.add_argument("--heads", default=None,
                        help=f"comma-separated subset of the decode head shapes {PLAN.heads}")
    parser.add_argument("--device-time", action="store_true",
                        help="time each call by the device's busy time in a profiler trace "
                        "(the kernels alone), for hosts slower than the calls")
    parser.add_argument("--sweep-points", default=None,
                        help="the decode sweep's points as BATCH:CONTEXT[,...] (Llama-3-8B "
                        "heads) instead of the plan's, e.g. 1:1024 for the batch-1 step")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="past this, skip the remaining sweeps and comparisons")
    args = parser.parse_args()
    if args.smoke:
        PLAN = SMOKE
    elif args.acceptance:
        PLAN = ACCEPTANCE
    if args.dispatch_included:
        PLAN = dataclasses.replace(PLAN, subtract_dispatch=False)
    if args.heads:
        unknown = set(args.heads.split(",")) - set(PLAN.heads)
        if unknown:
            parser.error(f"--heads: unknown {sorted(unknown)}; choose from {PLAN.heads}")
        PLAN = dataclasses.replace(PLAN, heads=tuple(args.heads.split(",")))
    if args.device_time:
        PLAN = dataclasses.replace(PLAN, device_time=True)
    if args.sweep_points:
        try:
            points = tuple((int(b), int(c), "llama3_8b") for b, c in
                           (p.split(":") for p in args.sweep_points.split(",")))
        except ValueError:
            parser.error(f"--sweep-points: expected BATCH:CONTEXT[,...], got "
                         f"{args.sweep_points!r}")
        PLAN = dataclasses.replace(PLAN, sweep_points=points)
    if args.no_prefill:
        PLAN = dataclasses.replace(PLAN, prefill_points=())
    start = time.time()
    results: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                     "commit": os.environ.get("JAXLLM_COMMIT"),
                     "dispatch_subtracted": PLAN.subtract_dispatch}

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    results["ceilings"] = ceilings()
    print("ceilings", results["ceilings"], flush=True)
    save()
    if not args.no_sweep:
        points = [DecodeProblem(*p) for p in PLAN.sweep_points]
        results["decode_sweep"] = sweep_decode(points, start + 0.3 * args.budget_s)
        save()
    tuned = pick_tuned(results.get("decode_sweep", {}))
    results["decode_tuned"] = tuned
    configs = {"pallas": DecodeConfig()}
    if tuned and SWEEP[tuned] != DecodeConfig():
        configs["pallas_tuned"] = SWEEP[tuned]
    impls = decode_impls(configs)
    results["decode"] = []
    for heads in PLAN.heads:
        for batch in PLAN.batches:
            for context in PLAN.contexts:
                if time.time() > start + args.budget_s:
                    print(f"decode {heads} {batch} {context}: skipped (time budget)")
                    continue
                row = bench_decode(DecodeProblem(batch, context, heads), impls,
                                   with_jax=not args.no_jax)
                results["decode"].append(row)
                print("decode", json.dumps(row), flush=True)
                save()

    results["prefill"] = []
    results["prefill_tuned"] = bench_prefill_points(
        PLAN, results["prefill"], save, deadline=start + args.budget_s,
        sweep=not args.no_prefill_sweep, with_reference=not args.no_prefill_reference,
        with_hopper=args.hopper and not PLAN.interpret,
        block=BLOCK, pseudo_random=pseudo_random, time_per_call=time_per_call)
    results["wall_s"] = time.time() - start
    save()
    print_table(results)
    return 0


def pick_tuned(sweep: dict) -> str | None:
    """The config with the best mean bandwidth over the swept GQA points."""
    scores: dict[str, list[float]] = {}
    for key, row in sweep.items():
        if "llama3_8b" not in key:
            continue
        for name, r in row.items():
            if isinstance(r, dict):
                scores.setdefault(name, []).append(r["TBps"])
    if not scores:
        return None
    most = max(map(len, scores.values()))
    full = {n: statistics.mean(s) for n, s in scores.items() if len(s) == most}
    return max(full, key=full.get)


def fmt(r, key="TBps"):
    return f"{r[key]:.2f}" if isinstance(r, dict) else "-"


def print_table(results: dict) -> None:
    copy = results["ceilings"]["copy_TBps"]
    print(f"\n{results['device']}  copy {copy:.2f} TB/s  "
          f"matmul {results['ceilings']['matmul_TFLOPs']:.0f} TFLOP/s")
    names = [n for n in ("pallas", "pallas_tuned", "reference", "jax_triton")
             if any(n in r for r in results["decode"])]
    print("decode TB/s (% copy): heads batch ctx | " + " | ".join(names))
    for r in results["decode"]:
        cells = [f"{fmt(r.get(n))} ({100 * r[n]['TBps'] / copy:.0f}%)" if isinstance(
            r.get(n), dict) else "-" for n in names]
        print(f"{r['heads']:>10} {r['batch']:>4} {r['context']:>5} | " + " | ".join(cells))
    print_prefill_table(results["prefill"])


if __name__ == "__main__":
    sys.exit(main())
