"""``python -m jaxllm.benchmarks.multihost_pair``: one model over two devices as two processes
joined by ``jax.distributed`` over localhost (one device each: the multi-host path on one
machine) against one process with TP 2 over both: the same greedy tokens, and what the process
boundary costs a step.

Each configuration runs in fresh processes: ``one`` = one process seeing devices 0 and 1,
``-tp 2``; ``two`` = node 0 on device 0 and node 1 (``run_worker``) on device 1, ``--nnodes 2
-tp 2``. Node 0 (or the one process) first generates greedily for four fixed prompts (their
tokens are compared), then times ``--num-prompts`` random prompts of ``--input-len`` tokens,
``--output-len`` each, offline: output tok/s and the mean step (wall time / engine steps).

    python -m jaxllm.benchmarks.multihost_pair --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 --num-prompts 256 --output-json /tmp/multihost_pair.json
    # on CPU (2 host devices; a tiny model):
    python -m jaxllm.benchmarks.multihost_pair --cpu \\
        --model tests/fixtures/tiny/llama3_rope_scaling --load-format auto --dtype float32 \\
        --num-prompts 8 --input-len 16 --output-len 16 --max-num-seqs 8
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

GREEDY_PROMPTS = [[128000, 791, 6864, 315, 9822, 374], [128000, 16, 11, 220, 17, 11, 220, 18],
                  [128000, 40, 1093, 311, 1373, 264, 3446], [128000, 3923, 374, 264, 4221]]


def engine_args(args: argparse.Namespace, nnodes: int, rank: int, port: int) -> dict:
    return dict(model=args.model, load_format=args.load_format, dtype=args.dtype,
                tensor_parallel_size=2, nnodes=nnodes, node_rank=rank, master_port=port,
                max_num_seqs=args.max_num_seqs, max_model_len=args.input_len + args.output_len
                + 16, enforce_eager=args.enforce_eager)


def run_node(args: argparse.Namespace) -> int:
    from jaxllm import LLM, EngineConfig, SamplingParams
    from jaxllm.engine.multihost import run_worker

    kw = engine_args(args, args.nnodes, args.node_rank, args.port)
    if args.node_rank > 0:
        return run_worker(EngineConfig(**kw))
    start = time.perf_counter()
    llm = LLM(**kw)
    ready = time.perf_counter() - start
    vocab = llm.engine.model.config.vocab_size
    greedy = [[t % vocab for t in p] for p in GREEDY_PROMPTS]
    outs = llm.generate(prompt_token_ids=greedy, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    rng = np.random.default_rng(0)
    prompts = rng.integers(10, min(vocab, 30000), (args.num_prompts, args.input_len)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:args.max_num_seqs], sampling_params=params,
                 use_tqdm=False)  # every step shape of the timed run compiled first
    steps = llm.engine.stats.num_steps
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps = llm.engine.stats.num_steps - steps
    print("RESULT " + json.dumps({
        "nnodes": args.nnodes, "ready_seconds": ready, "greedy_tokens": tokens,
        "seconds": seconds, "steps": steps, "step_ms": 1e3 * seconds / max(steps, 1),
        "output_tok_s": args.num_prompts * args.output_len / seconds}), flush=True)
    return 0


def free_port_pair() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as t:
                t.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def run_config(args: argparse.Namespace, nnodes: int, passthrough: list[str]) -> dict:
    port = free_port_pair()
    procs = []
    for rank in range(nnodes):
        env = dict(os.environ)
        if args.cpu:
            env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(2 // nnodes))
        else:
            env["CUDA_VISIBLE_DEVICES"] = "0,1" if nnodes == 1 else str(rank)
        argv = [sys.executable, "-m", "jaxllm.benchmarks.multihost_pair", "--node",
                "--nnodes", str(nnodes), "--node-rank", str(rank), "--port", str(port),
                *passthrough]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    try:
        out = procs[0].communicate(timeout=args.timeout)[0]
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if procs[0].returncode != 0 or not lines:
        raise SystemExit(f"the {nnodes}-process run failed (exit {procs[0].returncode})")
    return json.loads(lines[-1].split(" ", 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="2 host devices instead of 2 GPUs")
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--node", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nnodes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--node-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29501, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.node:
        return run_node(args)
    passthrough, skip = [], False  # the node processes get every flag but --output-json
    for a in argv if argv is not None else sys.argv[1:]:
        if not skip and a != "--output-json" and not a.startswith("--output-json="):
            passthrough.append(a)
        skip = a == "--output-json"
    results = {}
    for nnodes in (1, 2):
        results[nnodes] = run_config(args, nnodes, passthrough)
        r = results[nnodes]
        print(f"{'one process, TP 2' if nnodes == 1 else 'two processes, TP 2'}: ready in "
              f"{r['ready_seconds']:.1f} s; {r['output_tok_s']:.0f} output tok/s, "
              f"{r['steps']} steps of {r['step_ms']:.2f} ms", flush=True)
    same = results[1]["greedy_tokens"] == results[2]["greedy_tokens"]
    boundary = results[2]["step_ms"] - results[1]["step_ms"]
    print(f"greedy tokens {'identical' if same else 'DIFFER'}; the process boundary costs "
          f"{boundary:+.2f} ms a step ({100 * boundary / results[1]['step_ms']:+.1f}%)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "one_process": results[1],
                       "two_processes": results[2], "same_tokens": same,
                       "boundary_ms_per_step": boundary}, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
