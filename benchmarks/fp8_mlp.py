"""``python -m jaxllm.benchmarks.fp8_mlp``: the FP8 W8A8 MLP block (gate_up, SwiGLU, the
down projection's per-token quantization, down) as the engine runs it, against bf16, against
the same block with the FP8 GEMMs' output in bf16 instead of float32, and with SwiGLU and the
quantization in one pass (``pallas_kernels/activation_quant`` over gate_up's float32 or bf16
product, as ``JAXLLM_FP8_SWIGLU_KERNEL=f32`` / ``bf16`` runs it in the engine; in Pallas'
interpreter off the GPU).

Why: in the offline run's 8,192-token steps the FP8 GEMMs run at ~1.4 PFLOP/s, but the
activation quantization takes 13% of the step (RESULTS.md, 2026-12-04: the absmax over
SwiGLU's product and the conversion each read gate_up's float32 output again). A bf16 output
halves those reads if cuBLASLt's bf16-output FP8 GEMM is as fast; the one-pass kernel reads
the product once. This times each whole block (Llama-3-8B's MLP by default), compiled as the
engine compiles, and prints its output's distance from bf16's (what each costs in accuracy).

    python -m jaxllm.benchmarks.fp8_mlp --tokens 256,2048,8192 --output-json fp8_mlp.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from jaxllm.benchmarks.fp8_matmul import back_to_back_us
from jaxllm.benchmarks.provenance import source_commit, write_json


def _blocks():
    import jax
    import jax.numpy as jnp

    from jaxllm.layers.fp8 import fp8_product, quantize_tokens_fp8
    from jaxllm.layers.mlp import swiglu_mlp

    def engine(product_dtype=None):  # jaxllm.layers.mlp, as the model calls it
        return lambda x, gate_up, down: swiglu_mlp(x, gate_up, down,
                                                   product_dtype=product_dtype)

    def bf16_out(x, gate_up, down):  # XLA's passes with the FP8 GEMMs writing x's dtype
        def project(v, weight):
            xq, x_scale = quantize_tokens_fp8(v)
            y = fp8_product(xq, weight, v.dtype).astype(jnp.float32)
            return (y * x_scale * weight.scale).astype(v.dtype)
        pairs = project(x, gate_up).reshape(x.shape[0], -1, 2)
        return project(jax.nn.silu(pairs[..., 0]) * pairs[..., 1], down)

    # bf16 runs the engine's block over the float kernels
    return {"bf16": engine(), "fp8 (engine)": engine(), "fp8 GEMMs out bf16": bf16_out,
            "fp8 fused, product f32": engine(jnp.float32),
            "fp8 fused, product bf16": engine(jnp.bfloat16)}


def run(args) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxllm.layers.fp8 import quantize_fp8
    from jaxllm.quantization import compile_options as co
    from jaxllm.quantization.config import QuantizationConfig

    h, f = args.hidden, args.intermediate
    rng = np.random.default_rng(0)
    bf16 = {"gate_up": jnp.asarray(rng.standard_normal((h, 2 * f), np.float32) * 0.02,
                                   jnp.bfloat16),
            "down": jnp.asarray(rng.standard_normal((f, h), np.float32) * 0.02, jnp.bfloat16)}
    fp8 = {name: quantize_fp8(w) for name, w in bf16.items()}
    options = co.forward_compiler_options(QuantizationConfig(method="fp8"))
    blocks = _blocks()
    rows = []
    print(f"{'tokens':>6}  {'block':<22}{'us':>10}{'TFLOP/s':>9}{'vs bf16':>9}"
          f"{'rel. error':>12}  fusions", flush=True)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = jnp.asarray(rng.standard_normal((tokens, h), np.float32), jnp.bfloat16)
        base = reference = None
        for name, block in blocks.items():
            weights = bf16 if name == "bf16" else fp8
            call = (x, weights["gate_up"], weights["down"])
            step = jax.jit(block).lower(*call).compile(
                compiler_options={} if name == "bf16" else options)
            y = np.asarray(step(*call), np.float32)
            reference = y if reference is None else reference
            us = back_to_back_us(step, call, args.iters)
            base = base or us
            row = {"tokens": tokens, "block": name, "us": us,
                   "tflops": 2 * tokens * 3 * h * f / (us * 1e-6) / 1e12,
                   "speedup_vs_bf16": base / us,
                   # Frobenius norm of the difference from bf16's output, relative to it
                   "relative_error": float(np.linalg.norm(y - reference)
                                           / np.linalg.norm(reference)),
                   "fusions": step.as_text().count(" fusion(")}
            rows.append(row)
            print(f"{tokens:>6}  {name:<22}{us:>10.1f}{row['tflops']:>9.1f}"
                  f"{row['speedup_vs_bf16']:>8.2f}x{row['relative_error']:>12.2e}  "
                  f"{row['fusions']}", flush=True)
    result = {"commit": source_commit(), "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "hidden": h,
              "intermediate": f, "rows": rows}
    write_json(result, args.output_json)
    return result


def kernel_setting(result: dict) -> str:
    """The ``JAXLLM_FP8_SWIGLU_KERNEL`` value whose block was fastest at the result's largest
    token count ("off": XLA's passes were)."""
    largest = max(row["tokens"] for row in result["rows"])
    settings = {"fp8 (engine)": "off", "fp8 fused, product f32": "f32",
                "fp8 fused, product bf16": "bf16"}
    timed = {settings[row["block"]]: row["us"] for row in result["rows"]
             if row["tokens"] == largest and row["block"] in settings}
    return min(timed, key=timed.get)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,2048,8192")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--pick-from", default=None, metavar="JSON",
                        help="print the JAXLLM_FP8_SWIGLU_KERNEL setting this earlier run's "
                             "output found fastest, and time nothing")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.pick_from:
        with open(args.pick_from) as f:
            print(kernel_setting(json.load(f)))
        return
    run(args)


if __name__ == "__main__":
    main()
