"""``python -m jaxllm.benchmarks.fp8_matmul``: which formulation of the FP8 W8A8 projection
reaches an FP8 GEMM on this device, against the bf16 matmul it replaces.

Each variant is the whole projection as ``jaxllm.layers.linear`` would run it (per-token
activation quantization, the FP8 ``dot_general``, both scales on the output) at the Llama-3-8B
MLP's shape, for several token counts. The weight is stored either [K, N] (as the kernel
today) or [N, K] (K-major on both operands, the layout cuBLASLt's FP8 GEMM takes without a
transpose), and the dot's output type is float32 or bfloat16 (cuBLASLt accumulates in float32
either way). Printed: median microseconds, TFLOP/s, speed-up over bf16, and whether the
optimized HLO calls cuBLASLt's FP8 GEMM (``__cublas$lt$matmul$f8``). Calls are timed back to
back (one wait a round of ``--iters``), each compiled with the engine's options (FP8's GEMM
autotuning level). ``--device-time`` instead takes the device's busy time of ``--copies``
calls over distinct weights (so none is read from L2) from a profiler trace: the projections'
own kernels, which a slow host's dispatch cannot inflate (small token counts).

    python -m jaxllm.benchmarks.fp8_matmul --tokens 1,64,256,2048 --output-json fp8.json
    python -m jaxllm.benchmarks.fp8_matmul --variants "N,K" --k 14336 --n 4096   # down
    python -m jaxllm.benchmarks.fp8_matmul --shapes qkv,o,gate_up,down --tokens 1,16,64 \
        --variants "N,K] out bf" --device-time   # the engine's FP8 GEMMs at its decode steps
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
from jaxllm.benchmarks.provenance import source_commit, write_json


def back_to_back_us(step, args: tuple, iters: int) -> float:
    """Microseconds a call of ``step(*args)``: the median of 3 rounds of ``iters`` calls
    launched back to back with one wait a round (as the engine's steps launch: a small
    kernel's time, not its launch and wait), after 3 waited warm-up calls."""
    import jax

    for _ in range(3):
        jax.block_until_ready(step(*args))
    rounds = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            y = step(*args)
        jax.block_until_ready(y)
        rounds.append((time.perf_counter() - t) / iters)
    return 1e6 * float(np.median(rounds))


def _variants():
    import jax
    import jax.numpy as jnp

    from jaxllm.layers.fp8 import quantize_tokens_fp8

    def fp8_linear(x, wq, w_scale, *, k_major, out_dtype):
        xq, x_scale = quantize_tokens_fp8(x)
        dims = (((1,), (1,)), ((), ())) if k_major else (((1,), (0,)), ((), ()))
        y = jax.lax.dot_general(xq, wq, dims, preferred_element_type=out_dtype)
        return (y.astype(jnp.float32) * x_scale * w_scale).astype(x.dtype)

    def fp8_weight_only(x, wq, w_scale):
        # bf16 activations, the FP8 weight widened inside the GEMM's fusion (half of bf16's
        # weight bytes read; no activation quantization): what small token counts may want
        y = jax.lax.dot_general(x, wq.astype(x.dtype), (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return (y * w_scale).astype(x.dtype)

    variants = {"bf16": lambda x, w, s: x @ w, "fp8 weight-only w[N,K]": fp8_weight_only}
    for k_major in (False, True):
        for out in (jnp.float32, jnp.bfloat16):
            name = f"fp8 w[{'N,K' if k_major else 'K,N'}] out {jnp.dtype(out).name}"
            variants[name] = functools.partial(fp8_linear, k_major=k_major, out_dtype=out)
    return variants


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    from jaxllm.benchmarks.int4_matmul import SHAPES
    from jaxllm.benchmarks.latency import traced_busy_s

    from jaxllm.layers.fp8 import quantize_fp8
    from jaxllm.quantization import compile_options as co
    from jaxllm.quantization.config import QuantizationConfig

    if args.device_time and jax.default_backend() == "cpu":
        raise SystemExit("--device-time reads the GPU's kernels from a profiler trace: it "
                         "needs a GPU (this backend is cpu)")
    shapes = ({name: SHAPES["8b"][name] for name in args.shapes.split(",")} if args.shapes
              else {f"{args.k}x{args.n}": (args.k, args.n)})
    copies = args.copies if args.device_time else 1
    rng = np.random.default_rng(0)
    # The engine's FP8 compile options (XLA's default autotuner timed FP8 algorithms for
    # minutes a shape; the 2026-12-04 run of this benchmark died in it).
    options = co.forward_compiler_options(QuantizationConfig(method="fp8"))
    wanted = args.variants.split("|") if args.variants else [""]
    rows = []
    print(f"{'shape':<12}{'tokens':>6}  {'variant':<28}{'us':>10}{'TFLOP/s':>9}"
          f"{'weight TB/s':>12}{'vs bf16':>9}  FP8 GEMM", flush=True)
    for shape, (k, n) in shapes.items():
        w = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
             for _ in range(copies)]
        # the engine's load-time quantization: qt [N, K], scale [N]
        fp8 = [quantize_fp8(wi) for wi in w]
        w_scale = [f.scale for f in fp8]
        weights = {False: [jnp.asarray(f.qt.T) for f in fp8], True: [f.qt for f in fp8]}
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x = [jnp.asarray(rng.standard_normal((tokens, k), np.float32), jnp.bfloat16)
                 for _ in range(copies)]
            base = None
            for name, fn in _variants().items():
                if name != "bf16" and not any(v in name for v in wanted):
                    continue
                operand = w if name == "bf16" else weights["N,K" in name]
                calls = (x, operand, w_scale)
                # as the engine compiles; every copy's call in one program
                program = jax.jit(lambda xs, ws, ss, fn=fn: [
                    fn(*c) for c in zip(xs, ws, ss, strict=True)])
                step = program.lower(*calls).compile(
                    compiler_options={} if name == "bf16" else options)
                hlo = step.as_text()
                if args.device_time:
                    us = 1e6 * traced_busy_s(step, calls, args.iters) / copies
                else:
                    us = back_to_back_us(step, calls, args.iters)
                base = base or us
                row = {"shape": shape, "k": k, "n": n, "tokens": tokens, "variant": name,
                       "us": us, "tflops": 2 * tokens * k * n / (us * 1e-6) / 1e12,
                       "weight_tbps": operand[0].nbytes / (us * 1e-6) / 1e12,
                       "speedup_vs_bf16": base / us,
                       "cublaslt_fp8": "__cublas$lt$matmul$f8" in hlo}
                rows.append(row)
                print(f"{shape:<12}{tokens:>6}  {name:<28}{us:>10.1f}{row['tflops']:>9.1f}"
                      f"{row['weight_tbps']:>12.2f}{row['speedup_vs_bf16']:>8.2f}x  "
                      f"{row['cublaslt_fp8']}", flush=True)
    result = {"commit": source_commit(), "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "device_time": args.device_time, "copies": copies,
              "rows": rows}
    write_json(result, args.output_json)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,64,256,2048")
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=28672, help="default: Llama-3-8B's fused "
                        "gate_up projection (2 x 14336)")
    parser.add_argument("--shapes", default="", help="Llama-3-8B projections, e.g. "
                        "qkv,o,gate_up,down (instead of --k / --n)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--device-time", action="store_true",
                        help="the device's busy time from a profiler trace (a GPU)")
    parser.add_argument("--copies", type=int, default=8, help="--device-time: distinct "
                        "weights a program, so that none is read from L2")
    parser.add_argument("--variants", default="", help="|-separated substrings: only the "
                        "variants whose names hold one (bf16 always runs)")
    parser.add_argument("--output-json", default=None)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
