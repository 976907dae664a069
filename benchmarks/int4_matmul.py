"""``python -m jaxllm.benchmarks.int4_matmul``: the 4-bit (AWQ / GPTQ) projection on this
device against the bf16 matmul it replaces, at Llama-3-8B's and 70B's projection shapes: the
tiled Pallas kernel (``int4_matmul``, jaxllm's path above 16 tokens), the GEMV kernel
(``int4_gemv``, 1-16 tokens) and optionally XLA's dequantize-then-dot.

Each timed program runs ``--copies`` projections, each with its own weight, so that nothing is
hoisted and no weight is served from L2 (an 8 MB 4-bit weight fits in the H200's 50 MB). A
call's fixed cost (dispatch and the wait for the result: about 270 us on the H200 lease, more
than a whole decode projection) is taken out by timing the program at ``--copies`` and at half
as many and dividing the difference by the extra copies; ``us_raw`` keeps the plain quotient.
Printed per (shape, tokens, variant): median microseconds per projection, GB/s of weight bytes
read (words, scales and zeros; bf16: the kernel), that as a % of ``--peak-gbps`` (the H200's
4.8 TB/s), the speed-up over bf16, and each kernel's largest error against the reference on
this device relative to the reference's largest value ("BAD" above 2%). One failing variant is
printed and skipped; the JSON is rewritten after every row, so a run cut short keeps its rows.

``--gemv-sweep`` adds GEMV block configs and ends with the fastest of each (tokens, shape) as
lines to paste into ``GEMV_TABLE`` (pallas_kernels/quantized_matmul/gemv.py). ``--gemv-before``
adds the GEMV as it was before its denormal inner loop ("gemv before"), timed in the same
process as the current one ("gemv"). ``--hopper`` adds the Mosaic GPU kernel
(``int4_matmul_hopper_nk``, the weight converted to int4 [N, K] before the timing) and, at 1-4
tokens, the GEMV over that same weight (``int4_gemv_nk``; ``--nk-sweep`` adds its configs
beside its pick):

    python -m jaxllm.benchmarks.int4_matmul --models 8b --tokens 1 --gemv-before --gemv-sweep

    python -m jaxllm.benchmarks.int4_matmul --models 8b,70b --tokens 1,4,16 --output-json int4.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback

import numpy as np
from jaxllm.benchmarks.int4_configs import (  # the configs it times besides each kernel's pick
    GEMV_BEFORE,
    GEMV_CANDIDATE_TABLES,
    GEMV_MODES,
    GEMV_SWEEP,
    HOPPER_SWEEP,
    NK_GEMV_SWEEP,
)

# Projections (K, N) as jaxllm fuses them: qkv = q + k + v, gate_up = gate + up.
SHAPES = {
    "8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
           "down": (14336, 4096)},
    "70b": {"qkv": (8192, 10240), "o": (8192, 8192), "gate_up": (8192, 57344),
            "down": (28672, 8192)},
    "tiny": {"x": (256, 192)},  # a CPU smoke run with --interpret (no figures)
}
BAD_REL_ERR = 2e-2  # bf16 outputs: a few ulps of the largest value; a wrong nibble is ~100%


def _time(fn, args, iters: int) -> float:
    import jax

    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _weights(key, k: int, n: int, group: int, copies: int):
    """Random packed words, scales around 2e-3 and zero points, made on the device."""
    import jax
    import jax.numpy as jnp

    out = []
    for one in jax.random.split(key, copies):
        kw, ks, kz = jax.random.split(one, 3)
        words = jax.lax.bitcast_convert_type(
            jax.random.bits(kw, (k // 8, n), jnp.uint32), jnp.int32)
        scales = (jax.random.uniform(ks, (k // group, n), minval=0.5, maxval=1.5)
                  * 2e-3).astype(jnp.bfloat16)
        zeros = jax.random.randint(kz, (k // group, n), 0, 16).astype(jnp.uint8)
        out.append((words, scales, zeros))
    return [list(a) for a in zip(*out, strict=True)]


def _variants(tokens: int, k: int, n: int, group: int, args) -> dict:
    """name -> ("bf16" | "xla" | "matmul" | "gemv", config or None)."""
    from jaxllm.pallas_kernels.quantized_matmul import (
        Int4GemvConfig,
        Int4MatmulConfig,
        gemv_config,
        gemv_unsupported,
        nk_gemv_unsupported,
        unsupported,
    )
    from jaxllm.pallas_kernels.quantized_matmul.gemv_nk import nk_gemv_config
    from jaxllm.pallas_kernels.quantized_matmul.hopper import config_for as hopper_config_for
    from jaxllm.pallas_kernels.quantized_matmul.hopper import unsupported as hopper_unsupported

    variants = {"bf16": ("bf16", None)}
    if args.with_xla:
        variants["xla dequantize + dot"] = ("xla", None)
    if args.xla_int4:
        variants["xla int4 gemm"] = ("xla_int4", None)
    if args.hopper and nk_gemv_unsupported(tokens, k, n, group) is None:
        variants["gemv over N-major"] = ("gemv_nk", None)  # the Hopper layout's few tokens
        for label, kwargs in NK_GEMV_SWEEP if args.nk_sweep else ():
            config = dataclasses.replace(nk_gemv_config(tokens), **kwargs)
            if nk_gemv_unsupported(tokens, k, n, group, config) is None:
                variants[f"nk {label}"] = ("gemv_nk", config)
    if args.hopper and hopper_unsupported(tokens, k, n, group) is None:
        variants["hopper kernel"] = ("hopper", None)
        for label, kwargs in HOPPER_SWEEP if args.hopper_sweep else ():
            config = dataclasses.replace(hopper_config_for(tokens), **kwargs)
            if hopper_unsupported(tokens, k, n, group, config) is None:
                variants[f"hopper {label}"] = ("hopper", config)
    if unsupported(tokens, k, n, group) is None:
        variants["matmul kernel"] = ("matmul", None)
        if args.one_dot:
            variants["matmul kernel, one dot"] = ("matmul", Int4MatmulConfig(one_dot=True))
    if gemv_unsupported(tokens, k, n, group) is None:
        variants["gemv"] = ("gemv", gemv_config(tokens, k, n, group))
        rows = 1 << max(0, tokens - 1).bit_length()
        if args.gemv_before and not variants["gemv"][1].dot:  # the old rule's FMA config
            kwargs = GEMV_BEFORE.get((rows, k, n),
                                     dict(block_words=16 if rows <= 2 else 32 // rows))
            variants["gemv before"] = ("gemv", Int4GemvConfig(denormal=False, **kwargs))
        if args.gemv_modes and not variants["gemv"][1].dot:
            default = variants["gemv"][1]
            for label, kwargs in GEMV_MODES:
                config = dataclasses.replace(default, **kwargs)
                if gemv_unsupported(tokens, k, n, group, config) is None:
                    variants[f"gemv {label}"] = ("gemv", config)
            for name, table in GEMV_CANDIDATE_TABLES.items():
                if (rows, k, n) in table:
                    variants[f"gemv {name} table"] = ("gemv", Int4GemvConfig(**table[rows, k, n]))
    if args.gemv_sweep:
        for label, kwargs in GEMV_SWEEP:
            if kwargs.get("dot") and tokens < 4:
                continue
            config = Int4GemvConfig(**kwargs)
            if gemv_unsupported(tokens, k, n, group, config) is None:
                variants[f"gemv {label}"] = ("gemv", config)
    return variants


def _program(kind: str, config, group: int, interpret: bool):
    """A jitted function of (xs, weights...) running one projection per copy."""
    import jax
    from jaxllm.pallas_kernels.quantized_matmul import (
        int4_gemv,
        int4_gemv_nk,
        int4_matmul,
        int4_matmul_reference,
        int4_matmul_xla_int4,
    )
    from jaxllm.pallas_kernels.quantized_matmul.hopper import int4_matmul_hopper_nk
    from jaxllm.pallas_kernels.quantized_matmul.xla_int4 import COMPILE_OPTIONS

    if kind == "bf16":
        return jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws, strict=True)]), None
    # "hopper" and "gemv_nk" take the weight as int4 [N, K] (hopper_weight, converted outside
    # the timing)
    impl = {"xla": int4_matmul_reference, "matmul": int4_matmul, "gemv": int4_gemv,
            "xla_int4": int4_matmul_xla_int4, "hopper": int4_matmul_hopper_nk,
            "gemv_nk": int4_gemv_nk}[kind]
    kwargs = {"config": config} if config is not None else {}
    if kind != "xla" and interpret:
        kwargs["interpret"] = True

    def one(x, q, s, z):
        return impl(x, q, s, z, group_size=group, **kwargs)

    def many(xs, q, s, z):
        return [one(*a) for a in zip(xs, q, s, z, strict=True)]

    if kind == "xla_int4":  # XLA fuses the group scales into its GEMM only when told to
        return _with_options(many, COMPILE_OPTIONS), _with_options(one, COMPILE_OPTIONS)
    return jax.jit(many), jax.jit(one)


def _with_options(fn, options: dict):
    """``fn`` jitted and compiled with XLA ``options``, once per argument structure."""
    import jax

    compiled = {}

    def call(*args):
        key = jax.tree.structure(args)
        if key not in compiled:
            compiled[key] = jax.jit(fn).lower(*args).compile(compiler_options=options)
        return compiled[key](*args)

    return call


def _config_repr(config) -> str:
    """The config as code, naming only the fields that differ from the defaults."""
    import dataclasses

    default = type(config)()
    changed = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(default, f.name)}
    return f"{type(config).__name__}({', '.join(f'{k}={v!r}' for k, v in changed.items())})"


def _write(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    from jaxllm.benchmarks.latency import traced_busy_s
    from jaxllm.benchmarks.provenance import source_commit
    from jaxllm.pallas_kernels.quantized_matmul import int4_matmul_reference
    from jaxllm.pallas_kernels.quantized_matmul.hopper import hopper_weight

    group, copies = args.group_size, args.copies
    tokens_list = [int(t) for t in args.tokens.split(",")]
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "commit": source_commit(),
              "group_size": group, "copies": copies, "peak_gbps": args.peak_gbps, "rows": []}
    rows = result["rows"]
    print(f"{'model':<6}{'shape':<8}{'tokens':>6}  {'variant':<22}{'us':>9}{'GB/s':>8}"
          f"{'% peak':>8}{'vs bf16':>9}{'rel err':>10}", flush=True)
    key = jax.random.key(0)
    for model in args.models.split(","):
        shapes = SHAPES[model]
        for shape in (args.shapes.split(",") if args.shapes else shapes):
            k, n = shapes[shape]
            key, kw, kb, kx = jax.random.split(key, 4)
            qw, scales, zeros = _weights(kw, k, n, group, copies)
            w16 = [(jax.random.normal(kk, (k, n)) * 0.02).astype(jnp.bfloat16)
                   for kk in jax.random.split(kb, copies)]
            int4_bytes = k * n // 2 + (k // group) * n * 3  # words + bf16 scales + u8 zeros
            converted = {}  # the Hopper kernel's weights, made once a shape when first asked

            def hopper_weights(words, converted=converted):
                if "w" not in converted:
                    converted["w"] = [jax.jit(hopper_weight)(w) for w in words]
                return converted["w"]
            for tokens in tokens_list:
                xs = [jax.random.normal(kk, (tokens, k)).astype(jnp.bfloat16)
                      for kk in jax.random.split(jax.random.fold_in(kx, tokens), copies)]
                expected = jax.jit(lambda x, q, s, z: int4_matmul_reference(
                    x, q, s, z, group_size=group))(xs[0], qw[0], scales[0], zeros[0])
                expected = expected.astype(jnp.float32)
                base = None
                for name, (kind, config) in _variants(tokens, k, n, group, args).items():
                    row = {"model": model, "shape": shape, "k": k, "n": n, "tokens": tokens,
                           "variant": name, "kind": kind,
                           "config": None if config is None else _config_repr(config)}
                    weight_bytes = 2 * k * n if kind == "bf16" else int4_bytes
                    try:
                        many, one = _program(kind, config, group, args.interpret)
                        if kind == "bf16":
                            fargs = (xs, w16)
                        else:
                            n_major = kind in ("hopper", "gemv_nk")
                            fargs = (xs, hopper_weights(qw) if n_major else qw,
                                     scales, zeros)
                            got = one(*(a[0] for a in fargs)).astype(jnp.float32)
                            row["max_err"] = float(jnp.max(jnp.abs(got - expected)))
                            row["max_ref"] = float(jnp.max(jnp.abs(expected)))
                            row["rel_err"] = row["max_err"] / max(row["max_ref"], 1e-30)
                        full = _time(many, fargs, args.iters)
                        half = _time(many, [a[:copies // 2] for a in fargs], args.iters)
                        us = 1e6 * (full - half) / (copies - copies // 2)
                        row["us_raw"] = 1e6 * full / copies
                        if args.device_time:  # the projection's kernels, from a trace
                            row["us_wall"] = us
                            us = 1e6 * traced_busy_s(many, fargs, args.iters) / copies
                    except Exception as e:  # one variant failing must not end the sweep
                        row["error"] = f"{type(e).__name__}: {e}"[:500]
                        print(f"{model:<6}{shape:<8}{tokens:>6}  {name:<22} FAILED "
                              f"{row['error'][:200]}", flush=True)
                        if args.verbose:
                            traceback.print_exc()
                        rows.append(row)
                        _write(result, args.output_json)
                        continue
                    base = us if kind == "bf16" else base
                    gbps = weight_bytes / (us * 1e-6) / 1e9
                    row.update(us=us, weight_bytes=weight_bytes, gb_per_s=gbps,
                               pct_peak=100 * gbps / args.peak_gbps,
                               speedup_vs_bf16=(base / us) if base else None)
                    rows.append(row)
                    _write(result, args.output_json)
                    err = ""
                    if "rel_err" in row:
                        bad = " BAD" if row["rel_err"] > BAD_REL_ERR else ""
                        err = f"{row['rel_err']:>10.1e}{bad}"
                    speed = f"{row['speedup_vs_bf16']:>8.2f}x" if base else f"{'-':>9}"
                    print(f"{model:<6}{shape:<8}{tokens:>6}  {name:<22}{us:>9.1f}{gbps:>8.0f}"
                          f"{row['pct_peak']:>7.1f}%{speed}{err}", flush=True)
    _print_table(rows)
    _write(result, args.output_json)
    return result


def _print_table(rows: list[dict]) -> None:
    """The fastest correct GEMV config per (tokens, K, N), as GEMV_TABLE entries."""
    best: dict[tuple[int, int, int], dict] = {}
    for r in rows:
        if (r["kind"] != "gemv" or r.get("us", 0) <= 0
                or r.get("rel_err", 1) > BAD_REL_ERR):
            continue
        rows_pow2 = 1 << max(0, r["tokens"] - 1).bit_length()
        key = (rows_pow2, r["k"], r["n"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    if best:
        print("gemv table (fastest correct config; paste into GEMV_TABLE):")
    for key, r in sorted(best.items()):
        print(f"    {key}: {r['config']},  # {r['us']:.1f} us, {r['pct_peak']:.0f}% of peak")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="8b", help="of " + ", ".join(SHAPES))
    parser.add_argument("--shapes", default=None,
                        help="of qkv, o, gate_up, down (default: all)")
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--copies", type=int, default=16,
                        help="projections (each its own weight) per timed program")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--peak-gbps", type=float, default=4800.0,
                        help="the device's memory bandwidth (H200: 4.8 TB/s)")
    parser.add_argument("--with-xla", action="store_true",
                        help="also XLA's dequantize-then-dot (the path without kernels)")
    parser.add_argument("--gemv-sweep", action="store_true",
                        help="also the GEMV block configs of GEMV_SWEEP")
    parser.add_argument("--gemv-modes", action="store_true",
                        help="also the default GEMV with x read by the kernel and with the "
                        "split-K sums in the kernel (GEMV_MODES)")
    parser.add_argument("--gemv-before", action="store_true",
                        help="also the GEMV as it ran before the denormal loop (GEMV_BEFORE's "
                        "configs with the 2^23-magic loop), in the same process")
    parser.add_argument("--xla-int4", action="store_true",
                        help="also XLA's own int4 GEMM with the group scales fused in "
                        "(pallas_kernels/quantized_matmul/xla_int4.py; not in the engine)")
    parser.add_argument("--one-dot", action="store_true",
                        help="also the tiled kernel with one dot of K = block_k a step "
                        "(Int4MatmulConfig.one_dot)")
    parser.add_argument("--hopper", action="store_true",
                        help="also the Hopper kernel (Mosaic GPU, the weight as int4 [N, K] "
                        "converted before the timing; pallas_kernels/quantized_matmul/hopper.py)")
    parser.add_argument("--nk-sweep", action="store_true",
                        help="with --hopper: also the N-major GEMV's configs (NK_GEMV_SWEEP)")
    parser.add_argument("--hopper-sweep", action="store_true",
                        help="with --hopper: also its pipeline depths and step sizes "
                        "(HOPPER_SWEEP; a config past the shared memory fails alone)")
    parser.add_argument("--device-time", action="store_true",
                        help="us = the device's busy time a projection (its kernels and "
                        "XLA's ops around them, from a profiler trace of the --copies "
                        "program), not the wall-clock difference (us_wall); for hosts "
                        "slower than the calls")
    parser.add_argument("--interpret", action="store_true",
                        help="kernels in interpret mode (a CPU smoke run: --models tiny)")
    parser.add_argument("--verbose", action="store_true", help="tracebacks of failed variants")
    parser.add_argument("--output-json", default=None)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
