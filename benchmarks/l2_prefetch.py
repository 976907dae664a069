"""``python -m jaxllm.benchmarks.l2_prefetch``: how much faster a one-token 4-bit GEMV runs when
its weight was just read into L2, by device time (GPU only).

At batch 1 the decode step's GEMVs read their weights at 1.5-2.4 TB/s (RESULTS.md, H100,
2026-12-06) while the kernels between them (the norms, RoPE, the attention over one
sequence) leave HBM nearly idle for ~10 us a layer. If a kernel in that window read the next
projection's weight into the GPU's 50 MB L2, the GEMV would find it there. This measures the
bound of that before any kernel carries such reads: per projection, a program of ``--copies``
(distinct weights, so that none stays in L2 from the last use) each doing

    touch   a reduction over the first ``fraction`` of the weight's word rows, its scales and
            zeros (XLA's reduce: the bytes pass through L2), or, for the baseline, over
            another weight of the same size
    gemv    int4_gemv over the weight (tied after the touch by an optimization barrier)

and reports each kernel's device time a copy from a profiler trace (``step_profile``'s
reader): the GEMV with its own weight touched against the GEMV after the other touch.

    python -m jaxllm.benchmarks.l2_prefetch --shapes o,qkv,gate_up --fractions 1,0.5,0.25
"""

from __future__ import annotations

import argparse

from jaxllm.benchmarks.int4_matmul import SHAPES, _weights


def _touch(words, scales, zeros, fraction: float):
    """An int32 that depends on the first ``fraction`` of the word rows and on every scale and
    zero (a reduction reads each byte once)."""
    import jax.numpy as jnp

    rows = max(1, int(words.shape[0] * fraction))
    return (jnp.sum(words[:rows], dtype=jnp.int32)
            + jnp.sum(scales.astype(jnp.float32)).astype(jnp.int32)
            + jnp.sum(zeros, dtype=jnp.int32))


def _program(group: int, fraction: float, own: bool):
    import jax
    from jaxllm.pallas_kernels.quantized_matmul import int4_gemv

    def run(xs, words, scales, zeros, other_words, other_scales, other_zeros):
        outs = []
        for i, x in enumerate(xs):
            touched = ((words[i], scales[i], zeros[i]) if own
                       else (other_words[i], other_scales[i], other_zeros[i]))
            token = _touch(*touched, fraction)
            x, token = jax.lax.optimization_barrier((x, token))
            outs.append((int4_gemv(x, words[i], scales[i], zeros[i], group_size=group), token))
        return outs

    return jax.jit(run)


def _kernel_us(fn, args, copies: int, reps: int) -> dict:
    """Device us a copy by kernel group: 'gemv' (the Pallas GEMV), 'other' (XLA's ops)."""
    from jaxllm.benchmarks.latency import traced_calls

    summary = traced_calls(fn, args, reps, top=1000)
    per = 1e3 / (reps * copies)
    gemv = sum(k["total_ms"] for k in summary["kernels"] if "int4_gemv" in k["kernel"])
    other = sum(k["total_ms"] for k in summary["kernels"]
                if "int4_gemv" not in k["kernel"] and not k["kernel"].startswith("Memcpy"))
    return {"gemv_us": gemv * per, "other_us": other * per, "busy_us": summary["busy_ms"] * per}


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    from jaxllm.benchmarks.provenance import source_commit, write_json

    if jax.default_backend() != "gpu":
        raise SystemExit("l2_prefetch times GPU kernels from a profiler trace: it needs a GPU")
    result = {"device": jax.devices()[0].device_kind, "commit": source_commit(),
              "copies": args.copies, "rows": []}
    key = jax.random.key(0)
    print(f"{'shape':<8}{'fraction':>9}{'gemv cold us':>14}{'gemv touched us':>17}"
          f"{'touch us':>10}{'saved us':>10}", flush=True)
    for shape in args.shapes.split(","):
        k, n = SHAPES["8b"][shape]
        key, kw, ko, kx = jax.random.split(key, 4)
        words, scales, zeros = _weights(kw, k, n, args.group_size, args.copies)
        other = _weights(ko, k, n, args.group_size, args.copies)
        xs = [jax.random.normal(kk, (1, k)).astype(jnp.bfloat16)
              for kk in jax.random.split(kx, args.copies)]
        fargs = (xs, words, scales, zeros, *other)
        for fraction in (float(f) for f in args.fractions.split(",")):
            cold = _kernel_us(_program(args.group_size, fraction, own=False), fargs,
                              args.copies, args.reps)
            warm = _kernel_us(_program(args.group_size, fraction, own=True), fargs,
                              args.copies, args.reps)
            row = {"shape": shape, "k": k, "n": n, "fraction": fraction,
                   "cold": cold, "touched": warm,
                   "saved_us": cold["gemv_us"] - warm["gemv_us"]}
            result["rows"].append(row)
            print(f"{shape:<8}{fraction:>9.2f}{cold['gemv_us']:>14.2f}"
                  f"{warm['gemv_us']:>17.2f}{warm['other_us']:>10.2f}"
                  f"{row['saved_us']:>10.2f}", flush=True)
            write_json(result, args.output_json)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="o,qkv,gate_up",
                        help="of Llama-3-8B's: " + ", ".join(SHAPES["8b"]))
    parser.add_argument("--fractions", default="1,0.5,0.25",
                        help="the share of each weight's word rows the touch reads")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--output-json", default=None)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
