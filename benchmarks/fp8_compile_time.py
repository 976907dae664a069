"""``python -m jaxllm.benchmarks.fp8_compile_time``: how long the FP8 forward takes to compile
per step bucket under each GEMM autotuning setting, and how fast the compiled step then runs.

Why: the engine's FP8 warm-up took more than 4.5 minutes on the H200 (bf16: ~80 s) while XLA's
autotuner timed cuBLASLt FP8 algorithms for every GEMM of every bucket. This picks
``xla_gpu_autotune_level`` (``jaxllm/quantization/compile_options.py``) by measurement.

Each variant runs in its own process (XLA keeps autotuning results in memory for the life of a
process, so a second variant in the same one would reuse the first one's), with its flags
appended to ``XLA_FLAGS`` (or, ``--via compiler_options``, passed to ``.compile()`` as the
engine would pass them), no persistent compile cache. The process loads Llama-3-8B-shaped
dummy weights quantized at load time (``--quantization fp8``, layers unrolled as the engine
runs them on GPU), then per bucket compiles one step (the forward and the greedy sampler, the
pool donated) and times it. A bucket ``SxT`` is S sequences of T new tokens each after
``--context-len`` cached ones (``256x1``: a decode step of 256; ``8x256``: 2048 prefill
tokens). Printed per variant and bucket: compile seconds, median step ms; the JSON is
rewritten after each variant, and a variant cut by ``--timeout`` keeps the buckets it finished.

    python -m jaxllm.benchmarks.fp8_compile_time --output-json fp8_compile.json
    python -m jaxllm.benchmarks.fp8_compile_time --variants level4 --quantization none  # bf16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

VARIANTS = {
    "level0": {"xla_gpu_autotune_level": 0},
    "level1": {"xla_gpu_autotune_level": 1},
    "level4": {"xla_gpu_autotune_level": 4},  # XLA's default
    "level4-max4": {"xla_gpu_autotune_level": 4, "xla_gpu_autotune_max_solutions": 4},
}
DEFAULT_VARIANTS = "level0,level1,level4"
RESULT = "RESULT "  # a child's result lines start with this


def _flags(options: dict) -> str:
    return " ".join(f"--{k}={v}" for k, v in options.items())


def _step(model, seqs: int, new_tokens: int, context: int, block_size: int):
    """One step's function and arguments: ``seqs`` sequences, each ``new_tokens`` after
    ``context`` cached tokens, then a greedy sample (as ``bench latency``'s decode step)."""
    import jax

    from jaxllm import SeqChunk, make_forward, new_kv_pool, pack_batch
    from jaxllm.sampler_rows import build_sampling_metadata
    from jaxllm.sampling import sample

    cfg = model.config
    per_seq = -(-(context + new_tokens) // block_size)
    pool = new_kv_pool(cfg, 1 + seqs * per_seq, block_size, model.dtype,
                       unroll_layers=model.unroll_layers, mesh=model.mesh)
    chunks = [SeqChunk([100 + (i + t) % 50 for t in range(new_tokens)], context,
                       list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
              for i in range(seqs)]
    batch = jax.device_put(pack_batch(chunks, block_size))
    forward = make_forward(cfg, model.dtype, "auto", model.mesh)
    greedy = build_sampling_metadata([], seqs, 0, 0)

    def step(params, kv_pool, batch):
        logits, kv_pool = forward(params, kv_pool, batch)
        return sample(logits, greedy, all_greedy=True, use_top_k_top_p=False).sampled, kv_pool

    return jax.jit(step, donate_argnums=(1,)), pool, batch


def child(args) -> None:
    """Runs in the variant's process: prints one RESULT line per bucket (and one for the load)."""
    import jax

    import jaxllm

    jax.config.update("jax_enable_compilation_cache", False)
    options = VARIANTS[args.variant] if args.via == "compiler_options" else {}
    quant = None if args.quantization == "none" else args.quantization
    t = time.perf_counter()
    model = jaxllm.load_model(args.model, dtype="bfloat16", load_format="dummy",
                              unroll_layers=True, quantization=quant)
    jax.block_until_ready(model.params)
    print(RESULT + json.dumps({"load_s": time.perf_counter() - t}), flush=True)
    for bucket in args.buckets.split(","):
        seqs, new_tokens = (int(v) for v in bucket.split("x"))
        fn, pool, batch = _step(model, seqs, new_tokens, args.context_len, args.block_size)
        t = time.perf_counter()
        lowered = fn.lower(model.params, pool, batch)
        lower_s = time.perf_counter() - t
        exe = lowered.compile(compiler_options=options) if options else lowered.compile()
        compile_s = time.perf_counter() - t - lower_s
        for _ in range(3):
            tokens, pool = exe(model.params, pool, batch)
        jax.block_until_ready(tokens)
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            tokens, pool = exe(model.params, pool, batch)
            jax.block_until_ready(tokens)
            times.append(time.perf_counter() - t)
        print(RESULT + json.dumps({
            "bucket": bucket, "tokens": seqs * new_tokens, "lower_s": lower_s,
            "compile_s": compile_s, "step_ms": 1e3 * float(np.median(times)),
            "cublaslt_fp8": "__cublas$lt$matmul$f8" in exe.as_text()}), flush=True)
        del pool


def _run_variant(name: str, args) -> dict:
    env = dict(os.environ)
    if args.via == "xla_flags":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + _flags(VARIANTS[name])).strip()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "jaxllm.benchmarks.fp8_compile_time", "--child",
           "--variant", name, "--via", args.via, "--model", args.model,
           "--quantization", args.quantization, "--buckets", args.buckets,
           "--context-len", str(args.context_len), "--block-size", str(args.block_size),
           "--iters", str(args.iters)]
    record = {"variant": name, "options": VARIANTS[name], "via": args.via, "buckets": []}
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        out, err, record["returncode"] = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        record["timed_out"] = True
    record["process_s"] = time.perf_counter() - t
    for line in out.splitlines():
        if line.startswith(RESULT):
            item = json.loads(line[len(RESULT):])
            if "load_s" in item:
                record["load_s"] = item["load_s"]
            else:
                record["buckets"].append(item)
    if record.get("returncode") or record.get("timed_out"):
        record["stderr_tail"] = err[-2000:]
    return record


def run(args) -> dict:
    from jaxllm.benchmarks.provenance import source_commit, write_json

    result = {"commit": source_commit(), "model": args.model,
              "quantization": args.quantization, "context_len": args.context_len,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "variants": []}
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise ValueError(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
    print(f"{'variant':<13}{'bucket':>8}{'tokens':>8}{'compile s':>11}{'step ms':>10}"
          f"  FP8 GEMM", flush=True)
    for name in args.variants.split(","):
        record = _run_variant(name, args)
        result["variants"].append(record)
        write_json(result, args.output_json)
        for b in record["buckets"]:
            print(f"{name:<13}{b['bucket']:>8}{b['tokens']:>8}{b['compile_s']:>11.1f}"
                  f"{b['step_ms']:>10.3f}  {b['cublaslt_fp8']}", flush=True)
        total = sum(b["compile_s"] for b in record["buckets"])
        state = ("timed out" if record.get("timed_out") else
                 f"exit {record['returncode']}" if record.get("returncode") else "ok")
        print(f"{name:<13} load {record.get('load_s', float('nan')):.1f} s, compile "
              f"{total:.1f} s over {len(record['buckets'])} buckets, process "
              f"{record['process_s']:.1f} s ({state})", flush=True)
        if "stderr_tail" in record:
            print(record["stderr_tail"][-800:], flush=True)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="of " + ", ".join(VARIANTS))
    parser.add_argument("--via", default="xla_flags", choices=["xla_flags", "compiler_options"])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--quantization", default="fp8", help="fp8, or none for bf16")
    parser.add_argument("--buckets", default="1x1,256x1,8x256",
                        help="SxT: S sequences of T new tokens each")
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=420.0,
                        help="seconds for each variant's process")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
