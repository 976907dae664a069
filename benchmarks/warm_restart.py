"""Engine start-up, cold and warm (issue 16's warm restart): each start in a fresh process over
one cache directory, timing the phases the engine's ready line gives (weights, KV cache and
plan, warm-up: programs loaded from the executable cache vs compiled).

The starts, in order (``--starts``):

- ``cold``: an empty cache directory: every program traced, lowered, compiled and written.
- ``jax``: JAX's persistent cache warm, the executable cache emptied first: every program
  traced and lowered, its compile read from JAX's cache (the warm start before the
  executable cache; it also writes the executable cache's entries again).
- ``warm``: both warm: programs read from the executable cache, nothing traced.

    python -m jaxllm.benchmarks.warm_restart --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 --output-json /tmp/warm_restart.json
    python -m jaxllm.benchmarks.warm_restart --tiny   # CPU smoke run, a tiny random model
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from jaxllm.benchmarks.provenance import source_commit, write_json

# A tiny Llama (dummy weights) for CPU runs: seconds per start.
TINY_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256,
                   hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="float32")
ENGINE_ARGS = ("model", "load_format", "dtype", "max_num_seqs", "max_num_batched_tokens",
               "max_model_len", "tensor_parallel_size", "quantization")


def start_once(args: argparse.Namespace) -> dict:
    """One engine start in this process (the child): its phases, as JSON on stdout."""
    from jaxllm import EngineConfig, LLMEngine

    began = time.perf_counter()
    config = EngineConfig(compilation_cache_dir=args.cache_dir,
                          **{k: getattr(args, k) for k in ENGINE_ARGS})
    engine = LLMEngine(config, progress=False)
    return {"ready_s": time.perf_counter() - began,
            **{f"{k}_s": v for k, v in engine.startup_seconds.items()},
            "warm_up": engine.runner.warm_up_report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as jaxllm serve's (default: SmolLM2)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama (CPU runs)")
    parser.add_argument("--cache-dir", default=None, help="default: a new temporary directory")
    parser.add_argument("--starts", default="cold,jax,warm")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(start_once(args)))
        return

    scratch = tempfile.mkdtemp(prefix="jaxllm-warm-restart-")
    try:
        if args.tiny:
            args.model, args.load_format = os.path.join(scratch, "config.json"), "dummy"
            with open(args.model, "w") as f:
                json.dump(TINY_CONFIG, f)
        args.cache_dir = args.cache_dir or os.path.join(scratch, "cache")
        runs = []
        for kind in args.starts.split(","):
            if kind == "cold":
                shutil.rmtree(args.cache_dir, ignore_errors=True)
            elif kind == "jax":
                shutil.rmtree(os.path.join(args.cache_dir, "executables"), ignore_errors=True)
            elif kind != "warm":
                raise SystemExit(f"--starts: unknown start {kind!r} (cold, jax, warm)")
            child = [sys.executable, "-m", "jaxllm.benchmarks.warm_restart", "--child",
                     "--cache-dir", args.cache_dir]
            for name in ENGINE_ARGS:
                if getattr(args, name) is not None:
                    child += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            began = time.perf_counter()
            done = subprocess.run(child, capture_output=True, text=True)
            if done.returncode:
                sys.stderr.write(done.stderr)
                raise SystemExit(f"the {kind} start failed")
            run = {"start": kind, "process_s": time.perf_counter() - began,
                   **json.loads(done.stdout.strip().splitlines()[-1])}
            runs.append(run)
            w = run["warm_up"] or {}
            print(f"{kind:>5}: ready {run['ready_s']:6.1f} s (weights {run['weights_s']:.1f}, "
                  f"KV cache {run['kv_cache_s']:.1f}, warm-up {run['warm_up_s']:.1f}: "
                  f"{w.get('cached', 0)}/{w.get('programs', 0)} programs loaded in "
                  f"{w.get('load_seconds', 0):.1f} s, the rest compiled in "
                  f"{w.get('compile_seconds', 0):.1f} s); process {run['process_s']:.1f} s "
                  "(with imports)", flush=True)
        write_json({"benchmark": "warm_restart", "commit": source_commit(),
                    "args": {k: v for k, v in vars(args).items() if k != "child"},
                    "runs": runs}, args.output_json)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
