"""``python -m jaxllm.benchmarks.greedy_tokens``: the greedy tokens of fixed prompts under one
setting, or two such runs compared: the check that a switch which should not change any number
(an XLA flag, a launch mode) left the engine's outputs as they were.

A setting that lives in the environment (``XLA_FLAGS``, a ``JAXLLM_*`` switch) is read once a
process, so each setting is its own run; ``--compare`` then reads their JSONs:

    python -m jaxllm.benchmarks.greedy_tokens --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 -q awq --output-json off.json
    XLA_FLAGS=--xla_gpu_enable_pdl=true python -m jaxllm.benchmarks.greedy_tokens ... \\
        --output-json on.json
    python -m jaxllm.benchmarks.greedy_tokens --compare off.json on.json

The prompts are token ids (no tokenizer needed), of several lengths, so the run holds decode
steps of one and several rows and a chunked prefill. A switch that changes only the launch
must give the same tokens exactly; one that changes a sum's order may part two replies where
two logits tie within bf16 rounding, so the first differing position of each is printed.
"""

from __future__ import annotations

import argparse
import json
import sys


def prompts(count: int, vocab: int) -> list[list[int]]:
    """``count`` prompts of 24 + 53 i token ids, fixed (the same in every run)."""
    return [[(97 * i + 131 * j + 7) % (vocab - 200) + 100 for j in range(24 + 53 * i)]
            for i in range(count)]


def generate(args) -> dict:
    from jaxllm.benchmarks.provenance import source_commit

    from jaxllm import LLM, SamplingParams

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              quantization=args.quantization, max_num_seqs=args.num_prompts,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=1024,
              num_gpu_blocks_override=args.num_gpu_blocks_override,
              unroll_layers=args.unroll_layers or None, progress=False)
    vocab = llm.engine.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts(args.num_prompts, vocab),
                        sampling_params=params, use_tqdm=False)
    return {"commit": source_commit(), "model": args.model, "quantization": args.quantization,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def compare(a: dict, b: dict) -> dict:
    """How many replies of two runs agree; the first differing position of the others."""
    if len(a["tokens"]) != len(b["tokens"]):
        raise ValueError(f"{len(a['tokens'])} replies against {len(b['tokens'])}")
    parted = {}
    for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=True)):
        if x != y:
            parted[i] = next((j for j, (s, t) in enumerate(zip(x, y, strict=False))
                              if s != t), min(len(x), len(y)))
    return {"replies": len(a["tokens"]), "same": len(a["tokens"]) - len(parted),
            "first_difference": parted}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two runs' JSONs")
    p.add_argument("--model", default="llama-3-8b", help="a preset, a HF directory or .gguf")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=128,
                   help="small: few step buckets to compile, and the longer prompts chunked")
    p.add_argument("--num-gpu-blocks-override", type=int, default=2000)
    p.add_argument("--unroll-layers", action="store_true")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.compare:
        runs = []
        for path in args.compare:
            with open(path) as f:
                runs.append(json.load(f))
        result = compare(*runs)
        print(f"{result['same']} of {result['replies']} replies the same; first differing "
              f"position of the others: {result['first_difference'] or 'none'}")
        return 0 if result["same"] == result["replies"] else 1
    from jaxllm.benchmarks.provenance import write_json

    record = generate(args)
    write_json(record, args.output_json)
    print(f"{len(record['tokens'])} replies of {args.max_tokens} greedy tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
