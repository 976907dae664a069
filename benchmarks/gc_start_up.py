"""``python -m jaxllm.benchmarks.gc_start_up``: the Python objects an in-process engine leaves
for the garbage collector once started, and what one full collection of them costs.

An offline engine (``LLM``, ``bench throughput``) runs in the caller's process, where nothing
freezes the start-up heap (the serving engine core does: ``gc_watch.settle``). Every full
collection there walks what start-up left: on the H200 one took 1.3 s of an offline FP8 run's
step (RESULTS.md, 2026-12-06). Printed after the imports, the model's load and the engine's
start-up (every step bucket compiled, by default without the executable cache: a cold start):
tracked objects (``gc.get_objects``) and the milliseconds of one ``gc.collect()``.

    python -m jaxllm.benchmarks.gc_start_up --model smollm2-135m --unroll-layers
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile

from jaxllm.benchmarks.gc_pause import full_collection_ms


def _point(name: str) -> dict:
    collection_ms = full_collection_ms()
    point = {"at": name, "tracked": len(gc.get_objects()),
             "full_collection_ms": round(collection_ms, 1)}
    print(f"{name:<10} tracked objects {point['tracked']:>10,}   full collection "
          f"{point['full_collection_ms']:>8.1f} ms", flush=True)
    return point


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a preset, dummy weights")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--unroll-layers", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--compilation-cache-dir", default=None,
                        help="the engine's executable cache (default: a new empty one)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    points = [_point("imports")]
    from jaxllm.benchmarks.provenance import source_commit

    import jaxllm
    from jaxllm import EngineConfig, LLMEngine

    model = jaxllm.load_model(args.model, dtype=args.dtype, load_format="dummy",
                              unroll_layers=args.unroll_layers)
    points.append(_point("model"))
    with tempfile.TemporaryDirectory() as cold:
        config = EngineConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            num_gpu_blocks_override=1024, unroll_layers=args.unroll_layers,
            disable_log_stats=True, compilation_cache_dir=args.compilation_cache_dir or cold)
        engine = LLMEngine(config, model=model, progress=False, usage_context="llm_class")
        points.append(_point("engine"))
    result = {"commit": source_commit(), "args": vars(args), "points": points,
              "programs": engine.runner.warm_up_report.get("programs")}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
