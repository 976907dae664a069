"""Engine step anatomy: host time per phase vs device time, async scheduling on and off.

Runs one batch of ``--batch`` requests (``--input-len`` prompt, ``--output-len`` output, EOS
ignored) through the engine twice (the first round compiles), and reports for the second
round: output tokens/s, and per decode step the host time on the critical path (schedule,
prepare = pack + sampling metadata + dispatch, update = record samples), the host time that
overlaps the device (detokenize + outputs), and the time blocked on the device.

    python -m jaxllm.benchmarks.engine_step --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 \\
        --batch 256 --input-len 1024 --output-len 128 --mode async
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

# Let JAX's allocator reach what --gpu-memory-utilization asks for (its default stops at 75%).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jaxllm.benchmarks.provenance import source_commit, write_json

import jaxllm  # noqa: E402
from jaxllm import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

PHASES = ("schedule_seconds", "prepare_seconds", "update_seconds", "output_seconds",
          "device_wait_seconds")


def prefill_batch(engine: LLMEngine, tag: str, batch: int, input_len: int, output_len: int,
                  temperature: float = 0.0) -> None:
    """Adds ``batch`` requests of random prompt ids (EOS ignored) and steps until every one
    is decoding, so that what is timed next is decode steps only."""
    rng = np.random.default_rng(0)
    vocab = engine.model.config.vocab_size
    for i in range(batch):
        engine.add_request(f"{tag}{i}", prompt_token_ids=rng.integers(
            10, vocab - 10, input_len).tolist(), params=SamplingParams(
            temperature=temperature, max_tokens=output_len, ignore_eos=True))
    while engine.scheduler.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens
            for g in engine.scheduler.running for s in g.seqs):
        engine.step()


def run_round(engine: LLMEngine, args, tag: str) -> dict:
    prefill_batch(engine, tag, args.batch, args.input_len, args.output_len, args.temperature)
    stats = engine.stats
    before = {p: getattr(stats, p) for p in PHASES} | {"steps": stats.num_steps}
    start = time.perf_counter()
    generated_before = stats.generation_tokens
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    steps = stats.num_steps - before["steps"]
    per_step = {p.removesuffix("_seconds") + "_ms": 1e3 * (getattr(stats, p) - before[p]) / steps
                for p in PHASES}
    return {"decode_steps": steps, "seconds": elapsed,
            "output_tokens_per_s": (stats.generation_tokens - generated_before) / elapsed,
            "step_ms": 1e3 * elapsed / steps, **per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--mode", choices=["async", "sync"], default="async")
    parser.add_argument("--unroll-layers", action="store_true")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    model = jaxllm.load_model(args.model, load_format=args.load_format, dtype=args.dtype)
    engine = LLMEngine(EngineConfig(
        max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len + args.output_len + 16, enforce_eager=True,
        gpu_memory_utilization=args.gpu_memory_utilization, compilation_cache_dir=None,
        attention_backend=args.attention_backend, async_scheduling=args.mode == "async",
        unroll_layers=args.unroll_layers),
        model=model, progress=False)
    run_round(engine, args, "warm")
    result = run_round(engine, args, "timed")
    record = {
        "date": datetime.date.today().isoformat(),
        "commit": source_commit(),
        "device": jax.devices()[0].device_kind, "model": args.model, "dtype": str(model.dtype),
        "args": vars(args), **result,
    }
    print(json.dumps(record))
    print(f"{args.mode}: {result['output_tokens_per_s']:.0f} output tok/s, step "
          f"{result['step_ms']:.2f} ms = host schedule {result['schedule_ms']:.2f} + prepare "
          f"{result['prepare_ms']:.2f} + update {result['update_ms']:.2f} (critical path), "
          f"output {result['output_ms']:.2f} (overlapped), device wait "
          f"{result['device_wait_ms']:.2f}")
    write_json(record, args.output_json)


if __name__ == "__main__":
    main()
