"""Continuous batching (the engine) vs static batching, same model, same prompts, one run.

Static batching = ``jaxllm.generate`` on batches of ``--batch-size`` padded prompts: every
batch starts together and runs until its longest request is done, then the next batch starts.
Continuous batching = ``LLMEngine`` with ``max_num_seqs = --batch-size``: a finished request's
slot is refilled at the next step. Both use greedy decoding with fixed per-request output
lengths (EOS ignored), so both must produce exactly the same useful tokens: each side's count
comes from its outputs (static: ``generate()``'s ``num_tokens``, each row up to its own length;
continuous: the finished outputs), and the run fails when either differs from the requested
total. KV waste: :mod:`jaxllm.engine.kv_usage` for both. Compilation is done before timing in
both cases.

    python -m jaxllm.benchmarks.continuous_vs_static --num-prompts 64 --batch-size 16
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jaxllm.benchmarks.metrics import check_output_tokens
from jaxllm.benchmarks.provenance import source_commit, write_json

import jaxllm
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.kv_usage import KVUsage, contiguous_batch, engine_usage
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.sampling_params import SamplingParams


def make_workload(args) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(args.seed)
    vocab = 49152 if args.vocab is None else args.vocab
    prompts = [rng.integers(100, vocab, int(n)).tolist()
               for n in rng.integers(args.min_input, args.max_input + 1, args.num_prompts)]
    outputs = [int(n) for n in rng.integers(args.min_output, args.max_output + 1,
                                            args.num_prompts)]
    return prompts, outputs


def run_static(model, prompts, outputs, batch_size) -> tuple[float, int, KVUsage]:
    """Seconds, useful tokens counted from the outputs, and KV usage (each batch's rows own
    ``width + new`` contiguous slots while it runs)."""
    width = max(map(len, prompts))
    batches = []
    usage = KVUsage()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids = np.zeros((batch_size, width), np.int32)
        lens = np.ones(batch_size, np.int32)
        for i, p in enumerate(chunk):
            ids[i, :len(p)] = p
            lens[i] = len(p)
        wanted = outputs[start:start + batch_size]
        new = -(-max(wanted) // 16) * 16
        batches.append((jnp.asarray(ids), jnp.asarray(lens), new, wanted))
        usage += contiguous_batch(map(len, chunk), wanted, new, rows=batch_size, width=width,
                                  cache_len=width + new)
    call = lambda ids, lens, new: jaxllm.generate(
        model.params, ids, lens, jax.random.key(0), config=model.config, max_new_tokens=new)
    for new in sorted({b[2] for b in batches}):  # compile every shape before timing
        jax.block_until_ready(call(batches[0][0], batches[0][1], new).tokens)
    start = time.perf_counter()
    counts = [jax.block_until_ready(call(ids, lens, new).num_tokens)
              for ids, lens, new, _ in batches]
    elapsed = time.perf_counter() - start
    produced = sum(min(int(n), want) for c, (*_, wanted) in zip(counts, batches, strict=True)
                   for n, want in zip(np.asarray(c), wanted, strict=False))  # + padding rows
    return elapsed, produced, usage


def run_continuous(model, prompts, outputs, batch_size, max_batched) -> tuple[float, dict]:
    engine = LLMEngine(EngineConfig(max_num_seqs=batch_size, max_num_batched_tokens=max_batched,
                                    max_model_len=max(map(len, prompts)) + max(outputs) + 1),
                       model=model)
    kv_before = engine_usage(engine.stats)
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
        engine.add_request(str(i), prompt_token_ids=p, params=SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True))
    produced = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    stats = engine.stats
    return elapsed, {
        "generated_tokens": produced, "steps": stats.num_steps,
        "host_ms_per_step": 1e3 * stats.host_seconds / stats.num_steps,
        "overlapped_output_ms_per_step": 1e3 * stats.output_seconds / stats.num_steps,
        "device_wait_ms_per_step": 1e3 * stats.device_wait_seconds / stats.num_steps,
        **(engine_usage(stats) - kv_before).as_dict(),
        "warm_up_s": engine.warm_up_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--min-input", type=int, default=16)
    parser.add_argument("--max-input", type=int, default=128)
    parser.add_argument("--min-output", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default="benchmarks/results/continuous_vs_static.json")
    args = parser.parse_args()

    model = jaxllm.load_model(args.model, dtype=args.dtype, load_format=args.load_format)
    args.vocab = model.config.vocab_size
    prompts, outputs = make_workload(args)
    useful = sum(outputs)
    static_s, static_tokens, static_kv = run_static(model, prompts, outputs, args.batch_size)
    cont_s, cont = run_continuous(model, prompts, outputs, args.batch_size,
                                  args.max_num_batched_tokens)
    check_output_tokens("static", static_tokens, useful)
    check_output_tokens("continuous", cont["generated_tokens"], useful)
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": source_commit(),
        "device": f"{jax.devices()[0].device_kind} ({platform.processor() or platform.machine()}"
                  f", {os.cpu_count()} cores)",
        "model": model.name, "dtype": str(model.dtype), "args": vars(args),
        "useful_output_tokens": useful,
        "static": {"seconds": static_s, "output_tokens_per_s": useful / static_s,
                   "generated_tokens": static_tokens, **static_kv.as_dict()},
        "continuous": {"seconds": cont_s, "output_tokens_per_s": useful / cont_s, **cont},
        "speedup": static_s / cont_s,
    }
    write_json(result, args.output_json)
    print(f"{'':12}{'seconds':>10}{'out tok/s':>12}")
    print(f"{'static':12}{static_s:10.2f}{useful / static_s:12.1f}")
    print(f"{'continuous':12}{cont_s:10.2f}{useful / cont_s:12.1f}")
    print(f"speedup {result['speedup']:.2f}x; continuous: host critical path "
          f"{cont['host_ms_per_step']:.2f} ms/step, overlapped output work "
          f"{cont['overlapped_output_ms_per_step']:.2f} ms/step, device wait "
          f"{cont['device_wait_ms_per_step']:.2f} ms/step; KV waste {cont['kv_waste']:.1%} "
          f"(static {static_kv.waste:.1%})")


if __name__ == "__main__":
    main()
