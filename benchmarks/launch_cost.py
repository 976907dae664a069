"""Host time of launching one engine step: how long the jitted forward's and the sampler's
executable calls hold the host before they return, against the step's wall time.

JAX dispatch is asynchronous, but on GPU an executable call returns only after the host has
enqueued the step's work; with hundreds of kernels (an unrolled 32-layer forward) that can take
milliseconds unless XLA records them as CUDA graphs (command buffers). This runs ``--batch``
requests through the engine (async scheduling, as ``bench throughput``), wraps the runner's
compiled executables with a timer, and reports per decode step: the forward call, the sampler
call, the rest of the host's critical path, and the step. Run it once per ``XLA_FLAGS``
setting (flags are read when the backend starts, so one process each):

    XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m jaxllm.benchmarks.launch_cost \\
        --model llama-3-8b --load-format dummy --dtype bfloat16 --unroll-layers \\
        --output-json /tmp/launch_off.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
from jaxllm.benchmarks.engine_step import prefill_batch  # noqa: E402
from jaxllm.benchmarks.provenance import source_commit, write_json  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm import EngineConfig, LLMEngine  # noqa: E402
from jaxllm.engine.engine_config import resolve_unroll_layers  # noqa: E402


class TimedExecutable:
    """A compiled executable whose calls add their host time to ``totals[kind]``."""

    def __init__(self, exe, kind: str, totals: dict):
        self._exe, self._kind, self._totals = exe, kind, totals

    def __call__(self, *args):
        start = time.perf_counter()
        result = self._exe(*args)
        self._totals[self._kind] += time.perf_counter() - start
        self._totals[self._kind + "_calls"] += 1
        return result


def time_launches(runner, totals: dict) -> None:
    """Wraps every executable the runner hands out (already compiled ones included)."""
    forward, sampler = runner._forward_executable, runner._sampler_executable

    def timed_forward(*args, **kwargs):
        exe, shardings = forward(*args, **kwargs)
        return TimedExecutable(exe, "forward", totals), shardings

    runner._forward_executable = timed_forward
    runner._sampler_executable = lambda *a, **k: TimedExecutable(sampler(*a, **k), "sampler",
                                                                 totals)


def decode_round(engine: LLMEngine, args, tag: str, totals: dict) -> dict:
    prefill_batch(engine, tag, args.batch, args.input_len, args.output_len)
    stats = engine.stats
    steps0, host0, wait0 = stats.num_steps, stats.host_seconds, stats.device_wait_seconds
    for key in totals:
        totals[key] = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    steps = stats.num_steps - steps0
    ms = 1e3 / steps
    return {"decode_steps": steps, "step_ms": elapsed * ms,
            "forward_call_ms": totals["forward"] * ms, "forward_calls": totals["forward_calls"],
            "sampler_call_ms": totals["sampler"] * ms, "sampler_calls": totals["sampler_calls"],
            "host_critical_path_ms": (stats.host_seconds - host0) * ms,
            "device_wait_ms": (stats.device_wait_seconds - wait0) * ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--unroll-layers", action="store_true")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    unroll = resolve_unroll_layers(args.unroll_layers or None, jax.default_backend())
    model = jaxllm.load_model(args.model, load_format=args.load_format, dtype=args.dtype,
                              unroll_layers=unroll)
    engine = LLMEngine(EngineConfig(
        max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len + args.output_len + 16, compilation_cache_dir=None,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        unroll_layers=unroll, disable_log_stats=True),
        model=model, progress=False)
    totals = {"forward": 0.0, "forward_calls": 0, "sampler": 0.0, "sampler_calls": 0}
    time_launches(engine.runner, totals)
    decode_round(engine, args, "warm", totals)
    result = decode_round(engine, args, "timed", totals)
    record = {"date": datetime.date.today().isoformat(), "commit": source_commit(),
              "device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "args": vars(args), **result}
    print(json.dumps(record))
    print(f"XLA_FLAGS={record['xla_flags']!r}: decode step {result['step_ms']:.2f} ms; forward "
          f"call {result['forward_call_ms']:.2f} ms, sampler call {result['sampler_call_ms']:.2f}"
          f" ms, host critical path {result['host_critical_path_ms']:.2f} ms, device wait "
          f"{result['device_wait_ms']:.2f} ms")
    write_json(record, args.output_json)


if __name__ == "__main__":
    main()
