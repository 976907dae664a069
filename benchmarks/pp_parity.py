"""Pipeline-parallel parity on real devices: the same prompts through ``LLM`` on one device and
with ``-pp P`` (and ``-tp``), greedy; prints how many requests got the same tokens and writes
JSON. On GPUs this runs the Pallas attention kernels on the pipeline's micro-batches (CPU tests
run the XLA reference there), so it is the GPU check of ``jaxllm.parallel.pipeline``.

    python -m jaxllm.benchmarks.pp_parity -pp 2 --output-json pp_parity.json

Greedy tokens may part where two logits tie to within rounding (bf16): the first differing
position of each mismatch is listed, to tell a tie late in a reply from a wrong pipeline.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 (30 layers)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=2)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=900)
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="small enough that long prompts are chunked")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true",
                   help="compile each step shape when first met, not all at start (CPU smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def greedy_tokens(args, prompts, **parallel) -> list[list[int]]:
    from jaxllm import LLM, SamplingParams

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=32,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=0.4, attention_backend=args.attention_backend,
              enable_prefix_caching=True, progress=False, **parallel)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()  # the next engine plans its KV cache on what this one leaves
    return tokens


def main(argv=None) -> dict:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    shared = rng.integers(10, 1000, 48).tolist()  # a common prefix: prefix-cache hits
    prompts = [(shared if i % 4 == 0 else []) + rng.integers(10, 1000, int(n)).tolist()
               for i, n in enumerate(rng.integers(4, args.max_prompt_len, args.num_prompts))]
    one = greedy_tokens(args, prompts)
    pp = greedy_tokens(args, prompts, pipeline_parallel_size=args.pipeline_parallel_size,
                       tensor_parallel_size=args.tensor_parallel_size)
    first_diff = [next(i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b)
                  for x, y in zip(one, pp, strict=True) if x != y]
    same = len(prompts) - len(first_diff)
    result = {"model": args.model or "SmolLM2-135M-Instruct",
              "pipeline_parallel_size": args.pipeline_parallel_size,
              "tensor_parallel_size": args.tensor_parallel_size,
              "num_prompts": len(prompts), "same_tokens": same,
              "first_differing_positions": sorted(first_diff),
              "args": vars(args)}
    print(f"PP {args.pipeline_parallel_size} x TP {args.tensor_parallel_size}: {same} of "
          f"{len(prompts)} requests give one device's greedy tokens"
          + (f"; first differences at positions {sorted(first_diff)}" if first_diff else ""))
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
