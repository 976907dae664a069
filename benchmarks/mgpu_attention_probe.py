"""``python -m jaxllm.benchmarks.mgpu_attention_probe``: what a Hopper-native attention kernel
reaches on this GPU at the prefill acceptance shapes, beside our prefill kernel's figures.

Issue 17 asks the prefill kernel for >= 50% of the bf16 matmul rate on 2k-token chunks over
0-8k cached tokens; ours (Triton through Pallas: wgmma, no TMA, no warp specialization) stays
at 20-36%. Before building a Mosaic GPU kernel, this measures JAX's own Mosaic GPU flash
attention (``jax.experimental.pallas.ops.gpu.attention_mgpu``: TMA loads, a producer warpgroup
and two consumer warpgroups) on contiguous K/V of the same head layout (Llama-3-8B: 32 query
heads over 8 kv heads of 128), with the matmul rate measured in the same process. Not a
drop-in: it has no pages, and its causal mask has no offset, so a chunk over cached tokens is
timed without a mask over all of them (the FLOPs it did are counted: 4 * Hq * D per pair).

    python -m jaxllm.benchmarks.mgpu_attention_probe --output-json probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
POINTS = ((2048, 0), (2048, 2048), (2048, 8192))  # (chunk, cached)
# (block_q, block_kv, max_concurrent_steps); two consumer warpgroups: 2 x block_q query rows.
CONFIGS = ((64, 64, 2), (64, 128, 2), (128, 64, 2), (128, 128, 2), (64, 128, 3))
CALLS = 8  # calls a timed program (the launch divided among them)


def probe(chunk: int, cached: int, block_q: int, block_kv: int, steps: int, dtype) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
    from jaxllm.benchmarks.kernels import time_per_call

    kv_len = chunk + cached
    causal = cached == 0
    keys = jax.random.split(jax.random.key(0), CALLS + 2)
    k = (jax.random.normal(keys[0], (1, kv_len, KV_HEADS, HEAD_DIM)) * 0.5).astype(dtype)
    v = jax.random.normal(keys[1], (1, kv_len, KV_HEADS, HEAD_DIM)).astype(dtype)
    # One query array per call: identical calls in one program could be merged by XLA.
    qs = [(jax.random.normal(key, (1, chunk, HEADS, HEAD_DIM)) * 0.5).astype(dtype)
          for key in keys[2:]]
    config = mgpu.TuningConfig(block_q=block_q, block_kv=block_kv,
                               max_concurrent_steps=steps, causal=causal)
    pairs = chunk * (chunk + 1) // 2 if causal else chunk * kv_len
    try:
        out = mgpu.attention(qs[0], k, v, config)
        # The kernel applies no 1/sqrt(D) scale: its module's reference neither.
        reference = mgpu.attention_reference(qs[0], k, v, causal=causal)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))))
        sec = time_per_call(lambda i, k, v, *qs: mgpu.attention(qs[i], k, v, config), CALLS,
                            (k, v, *qs))
    except Exception as e:  # noqa: BLE001 (a config the kernel refuses is a row, not a stop)
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {"us": sec * 1e6, "TFLOPs": 4 * HEADS * HEAD_DIM * pairs / sec / 1e12,
            "causal": causal, "max_abs_err": err}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from jaxllm.benchmarks import kernels
    from jaxllm.benchmarks.provenance import source_commit, write_json

    ceilings = kernels.ceilings()
    peak = ceilings["matmul_TFLOPs"]
    print(f"{jax.devices()[0].device_kind}: bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    rows = []
    for (chunk, cached), (bq, bkv, steps) in itertools.product(POINTS, CONFIGS):
        row = {"chunk": chunk, "cached": cached, "block_q": bq, "block_kv": bkv,
               "max_concurrent_steps": steps,
               **probe(chunk, cached, bq, bkv, steps, jnp.dtype(args.dtype))}
        if "TFLOPs" in row:
            row["share_of_matmul"] = row["TFLOPs"] / peak
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("chunk cached | best config TFLOP/s (share of the matmul rate)")
    for chunk, cached in POINTS:
        ok = [r for r in rows if r["chunk"] == chunk and r["cached"] == cached and "TFLOPs" in r]
        best = max(ok, key=lambda r: r["TFLOPs"], default=None)
        print(f"{chunk} {cached} | " + ("all configs failed" if best is None else
              f"q{best['block_q']}_kv{best['block_kv']}_s{best['max_concurrent_steps']} "
              f"{best['TFLOPs']:.0f} ({100 * best['share_of_matmul']:.0f}%)"))
    write_json({"commit": source_commit(), "device": jax.devices()[0].device_kind,
                "dtype": args.dtype, "ceilings": ceilings, "rows": rows}, args.output_json)


if __name__ == "__main__":
    main()
