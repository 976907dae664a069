"""One node of a multi-host test, run by ``tests/test_multihost.py`` in its own process (each
with ``JAX_NUM_CPU_DEVICES`` CPU devices): ``--nnodes 1`` is the single-process reference.

Node 0 generates greedily for PROMPTS through ``LLM`` and prints ``TOKENS <json>``; with
``--keep-going`` it then prints ``BUSY`` and generates until it is killed or fails (a worker
killed meanwhile must end it). Other nodes run the worker loop (``run_worker``) and exit with
its status.

Four nodes, TP 2 x PP 2, by hand (not in CI: ~2 min on 2 cores; same tokens as one process,
checked 2026-12-02): ``--nnodes 4 --node-rank R --tp 2 --pp 2`` with ``JAX_NUM_CPU_DEVICES=1``
for R = 0..3, and ``--tp 2 --pp 2`` with ``JAX_NUM_CPU_DEVICES=4`` for the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(os.path.dirname(HERE), "fixtures", "tiny", "llama3_rope_scaling")
# A greedy request and a sampled one with n=2 (its two sequences share the prompt's last,
# partial block: a copy-on-write block copy), all in one prefill step and then decoding
# together: two forward shapes and one sampler variant to compile.
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28],
           [27, 18, 28, 18, 28, 45, 90, 45, 23, 53, 60, 28, 74]]


def engine_args(args: argparse.Namespace) -> dict:
    return dict(model=TINY, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                nnodes=args.nnodes,
                node_rank=args.node_rank, master_port=args.port, compilation_cache_dir=None,
                max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                num_gpu_blocks_override=40, block_size=8,
                enforce_eager=True)  # compiles only the shapes used: a few, not all buckets


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=29501)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--keep-going", action="store_true")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s [node {args.node_rank}] "
                                                   "%(name)s: %(message)s")
    from jaxllm import EngineConfig, SamplingParams
    from jaxllm.engine.multihost import run_worker

    if args.node_rank > 0:
        return run_worker(EngineConfig(**engine_args(args)))
    from jaxllm import LLM

    llm = LLM(**engine_args(args))
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=8, n=2, ignore_eos=True)]
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    tokens = [[list(c.token_ids) for c in o.outputs] for o in outs]
    print("TOKENS " + json.dumps(tokens), flush=True)
    if args.keep_going:
        print("BUSY", flush=True)
        while True:
            llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
