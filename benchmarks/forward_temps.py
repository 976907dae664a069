"""``python -m jaxllm.benchmarks.forward_temps``: the device temporaries of the engine's forward
(and sampler) at given token counts, compiled, not run: what the KV planner subtracts
(:func:`jaxllm.engine.kv_sizing.activation_bytes`). ``--barriers`` compiles the same shapes
with other forms of :func:`jaxllm.layers.linear._after_input`: ``none``, the forward before
``943e1c5``, whose unrolled layers could all hold their dequantized weights at once (issue 16:
the Llama-3-70B AWQ run ran out of memory asking 35.6 GiB); ``small``, only a 4-bit weight's
scales and zero points through the barrier; ``unused-x``, the barrier before 2026-12-05,
whose x output the matmul did not use (XLA dropped it where it fused x's producer into the
GEMM: 27.8 GiB at 2,048 tokens on the H200).

    python -m jaxllm.benchmarks.forward_temps --model llama-3-70b --load-format dummy \\
        --quantization awq --tokens 64,2048 --barriers full,none,small
"""

from __future__ import annotations

import argparse
import importlib
import time

from jaxllm.benchmarks.provenance import source_commit, write_json

GiB = 1 << 30


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-70b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--tokens", default="64,2048", help="comma-separated token counts")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--table-width", type=int, default=512, help="blocks a sequence holds")
    parser.add_argument("--attention-backend", default=None, help="default: the engine's")
    parser.add_argument("--no-unroll-layers", action="store_true")
    parser.add_argument("--barriers", default="full",
                        help="comma-separated, of full (the engine's), none, small")
    parser.add_argument("--compare-without-barrier", action="store_true",
                        help="the same as --barriers full,none")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    import jax

    from jaxllm.engine.kv_sizing import activation_bytes
    from jaxllm.loading import load_model

    linear = importlib.import_module("jaxllm.layers.linear")  # the module, not the function
    t0 = time.perf_counter()
    model = load_model(args.model, load_format=args.load_format, dtype=args.dtype,
                       quantization=args.quantization, unroll_layers=not args.no_unroll_layers)
    print(f"{args.model} {args.quantization or args.dtype}: loaded in "
          f"{time.perf_counter() - t0:.1f} s on {jax.devices()[0].device_kind}")
    backend = args.attention_backend or ("pallas" if jax.default_backend() == "gpu"
                                         else "reference")
    full = linear._after_input

    def small(x, weight):  # a 4-bit (qweight, scales, zeros): the small parts only
        if not isinstance(weight, tuple):
            return full(x, weight)
        x, parts = full(x, weight[1:])
        return x, (weight[0], *parts)

    def unused_x(x, weight):  # the barrier before 2026-12-05: its x output unused
        return x, full(x, weight)[1]

    forms = {"full": full, "none": lambda x, w: (x, w), "small": small, "unused-x": unused_x}
    variants = "full,none" if args.compare_without_barrier else args.barriers
    rows = []
    for variant in variants.split(","):
        if variant not in forms:
            parser.error(f"--barriers: {variant!r} is not one of {', '.join(forms)}")
        linear._after_input = forms[variant]
        for tokens in (int(t) for t in args.tokens.split(",")):
            t0 = time.perf_counter()
            temp = activation_bytes(model, tokens, min(args.max_num_seqs, tokens),
                                    args.table_width, backend)
            rows.append({"variant": variant, "tokens": tokens, "temp_bytes": temp,
                         "compile_s": time.perf_counter() - t0})
            print(f"{variant:>10}  {tokens:6d} tokens  temporaries {temp / GiB:8.2f} GiB  "
                  f"(compiled in {rows[-1]['compile_s']:.1f} s)", flush=True)
    linear._after_input = full
    write_json({"benchmark": "forward_temps", "commit": source_commit(), "args": vars(args),
                "device": jax.devices()[0].device_kind, "rows": rows}, args.output_json)


if __name__ == "__main__":
    main()
