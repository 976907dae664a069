"""``python -m jaxllm.benchmarks.int4_matmul``: the 4-bit (AWQ / GPTQ) projection on this
device, against the bf16 matmul it replaces: XLA's dequantize-then-dot (``jaxllm.layers.linear``
before the kernel) and the Pallas kernel (``pallas_kernels/quantized_matmul``) in several block
configs, at Llama-3-8B's projection shapes.

Each timed program runs ``--copies`` projections, each with its own weight, so that nothing is
hoisted and no weight is served from L2 (an 8 MB 4-bit weight fits in the H200's 50 MB). A
call's fixed cost (dispatch and the wait for the result: about 270 us on the H200 lease, more
than a whole decode projection) is taken out by timing the program at ``--copies`` and at half
as many and dividing the difference by the extra copies; ``us_raw`` keeps the plain quotient.
Printed per (shape, tokens, variant): median microseconds per projection, GB/s of weight bytes
read (the roofline for decode), speed-up over bf16, and for the kernel its largest error
against the reference on this device. One failing config is printed and skipped.

    python -m jaxllm.benchmarks.int4_matmul --tokens 1,16,64,256 --output-json int4.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import numpy as np

# Llama-3-8B's projections (K, N) as jaxllm fuses them.
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
# (block_n, block_k, num_splits, num_warps, num_stages); None splits: the kernel's auto rule.
KERNEL_CONFIGS = [(128, 128, None, 4, 3), (64, 128, None, 4, 3), (128, 256, None, 4, 3),
                  (256, 128, None, 8, 3), (128, 128, None, 4, 4), (64, 256, None, 4, 4),
                  (128, 128, 1, 4, 3), (32, 128, None, 4, 3)]


def _time(fn, args, iters: int) -> float:
    for _ in range(3):
        jax_block(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax_block(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def jax_block(out):
    import jax

    return jax.block_until_ready(out)


def _weights(rng, k: int, n: int, group: int, copies: int):
    import jax.numpy as jnp

    groups = k // group
    qw = [jnp.asarray(rng.integers(-2**31, 2**31, (k // 8, n), dtype=np.int64).astype(np.int32))
          for _ in range(copies)]
    scales = [jnp.asarray(rng.uniform(0.5, 1.5, (groups, n)) * 2e-3, jnp.bfloat16)
              for _ in range(copies)]
    zeros = [jnp.asarray(rng.integers(0, 16, (groups, n), dtype=np.uint8))
             for _ in range(copies)]
    return qw, scales, zeros


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    from jaxllm.pallas_kernels.quantized_matmul import (
        Int4MatmulConfig,
        int4_matmul,
        int4_matmul_reference,
    )

    rng = np.random.default_rng(0)
    rows, group, copies = [], args.group_size, args.copies
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    tokens_list = [int(t) for t in args.tokens.split(",")]
    configs = KERNEL_CONFIGS[:args.max_configs]
    print(f"{'shape':<8}{'tokens':>6}  {'variant':<34}{'us':>9}{'GB/s':>8}{'vs bf16':>9}"
          f"{'max err':>10}")
    for shape, (k, n) in shapes.items():
        qw, scales, zeros = _weights(rng, k, n, group, copies)
        w16 = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
               for _ in range(copies)]
        int4_bytes = k * n // 2 + (k // group) * n * 3  # words + bf16 scales + u8 zeros
        for tokens in tokens_list:
            xs = [jnp.asarray(rng.standard_normal((tokens, k), np.float32), jnp.bfloat16)
                  for _ in range(copies)]
            reference = jax.jit(lambda x, q, s, z: int4_matmul_reference(
                x, q, s, z, group_size=group))
            expected = reference(xs[0], qw[0], scales[0], zeros[0])
            variants = {"bf16": (None, 2 * k * n)}
            variants["xla dequantize + dot"] = (int4_matmul_reference, int4_bytes)
            for bn, bk, splits, warps, stages in configs:
                config = Int4MatmulConfig(block_n=bn, block_k=bk, num_splits=splits,
                                          num_warps=warps, num_stages=stages)
                name = f"pallas n{bn} k{bk} s{splits or 'auto'} w{warps} st{stages}"
                variants[name] = (config, int4_bytes)
            base = None
            for name, (impl, weight_bytes) in variants.items():
                row = {"shape": shape, "k": k, "n": n, "tokens": tokens, "variant": name}
                try:
                    if impl is None:
                        fn = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws, strict=True)])
                        fargs = (xs, w16)
                    else:
                        if impl is int4_matmul_reference:
                            one = lambda x, q, s, z: int4_matmul_reference(
                                x, q, s, z, group_size=group)
                        else:
                            one = (lambda cfg: lambda x, q, s, z: int4_matmul(
                                x, q, s, z, group_size=group, config=cfg))(impl)
                            got = jax.jit(one)(xs[0], qw[0], scales[0], zeros[0])
                            err = jnp.max(jnp.abs(got.astype(jnp.float32)
                                                  - expected.astype(jnp.float32)))
                            row["max_err"] = float(err)
                            row["max_ref"] = float(jnp.max(jnp.abs(expected.astype(
                                jnp.float32))))
                        fn = jax.jit(lambda xs, q, s, z, one=one: [
                            one(*a) for a in zip(xs, q, s, z, strict=True)])
                        fargs = (xs, qw, scales, zeros)
                    full = _time(fn, fargs, args.iters)
                    half = _time(fn, [a[:copies // 2] for a in fargs], args.iters)
                    us = 1e6 * (full - half) / (copies - copies // 2)
                    row["us_raw"] = 1e6 * full / copies
                except Exception as e:  # one config failing must not end the sweep
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                    print(f"{shape:<8}{tokens:>6}  {name:<34} FAILED {row['error'][:200]}")
                    if args.verbose:
                        traceback.print_exc()
                    rows.append(row)
                    continue
                base = us if name == "bf16" else base
                row.update(us=us, gb_per_s=weight_bytes / (us * 1e-6) / 1e9,
                           speedup_vs_bf16=(base / us) if base else None)
                rows.append(row)
                err = f"{row['max_err']:>10.2e}" if "max_err" in row else ""
                speed = f"{row['speedup_vs_bf16']:>8.2f}x" if base else f"{'-':>9}"
                print(f"{shape:<8}{tokens:>6}  {name:<34}{us:>9.1f}{row['gb_per_s']:>8.0f}"
                      f"{speed}{err}", flush=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "group_size": group, "copies": copies, "rows": rows}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,256")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--copies", type=int, default=16,
                        help="projections (each its own weight) per timed program")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--max-configs", type=int, default=len(KERNEL_CONFIGS))
    parser.add_argument("--verbose", action="store_true", help="tracebacks of failed configs")
    parser.add_argument("--output-json", default=None)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
