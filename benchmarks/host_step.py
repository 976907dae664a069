"""The engine's per-step host path at 256-1024 running decode sequences, phase by phase.

Issue 17's "host path": schedule + pack + transfer + launch + record must stay well under the
device step. This measures those phases on any backend with a tiny model (its device work is
negligible; the host work depends only on the row count, the context and the engine's flags):

- ``schedule``: ``Scheduler.schedule`` (block bookkeeping included);
- ``moves``: the scheduler's block moves (swap/copy; none in a steady decode batch);
- ``pack``: the scheduled chunks into numpy step metadata (no device);
- ``transfer``: the rest of ``prepare_forward``, the metadata's host-to-device copy;
- ``forward_launch`` / ``sampler_launch``: the executable calls until they return;
  ``sampler_rows``: the engine's per-row sampler inputs (the rest of ``LLMEngine._launch``),
  ``sampling_md``: their arrays (``build_sampling_metadata``);
- ``update``: recording the sampled tokens (``EngineStats.update_seconds``).

The prompts (``--context`` tokens, the first half shared by every request) are "prefilled"
by the real scheduler without a model (the KV content does not matter for the host's work),
then ``--steps`` decode steps run through ``LLMEngine.step`` after ``--warm-steps``, and a
further window runs under cProfile. Prints a table per configuration, writes JSON.

    PYTHONPATH=. python3 -m jaxllm.benchmarks.host_step --num-seqs 256 1024 \\
        --prefix-caching off on --output-json /tmp/host_step.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import functools
import gc
import io
import json
import pstats
import time

import numpy as np

PHASES = ("schedule", "moves", "pack", "transfer", "forward_launch", "sampler_rows",
          "sampling_md", "sampler_launch", "update")


def _timed(totals: dict, name: str, fn):
    """``fn`` adding its wall time to ``totals[name]`` and its thread's CPU time to
    ``totals[name + "_cpu"]`` (on a loaded machine the CPU time is the steadier figure)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
            totals[name + "_cpu"] += time.thread_time() - cpu
    return wrapper


class GcTimer:
    """Time spent in the garbage collector (gc.callbacks) while ``on``."""

    def __init__(self) -> None:
        self.on, self._start = False, 0.0
        self.reset()
        gc.callbacks.append(self._callback)

    def reset(self) -> None:
        self.by_generation = [[0, 0.0], [0, 0.0], [0, 0.0]]  # [collections, seconds]
        self.longest = 0.0  # seconds of the longest collection

    @property
    def seconds(self) -> float:
        return sum(seconds for _, seconds in self.by_generation)

    @property
    def collections(self) -> int:
        return sum(count for count, _ in self.by_generation)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.on:
            generation = self.by_generation[info["generation"]]
            seconds = time.perf_counter() - self._start
            generation[0] += 1
            generation[1] += seconds
            self.longest = max(self.longest, seconds)


_CURRENT: list[collections.Counter] = []  # the engine being measured's totals


def instrument(engine, totals: collections.Counter) -> None:
    """Wraps the phases' functions on this engine (instance attributes: nothing global
    changes but the runner module's sampling-metadata builder, wrapped once and adding to
    the totals of the engine instrumented last)."""
    from jaxllm.engine import model_runner

    runner = engine.runner
    engine.scheduler.schedule = _timed(totals, "schedule", engine.scheduler.schedule)
    runner._apply_block_moves = _timed(totals, "moves", runner._apply_block_moves)
    runner.pack = _timed(totals, "pack", runner.pack)
    runner.prepare_forward = _timed(totals, "prepare", runner.prepare_forward)
    runner.launch_forward = _timed(totals, "forward_launch", runner.launch_forward)
    runner.launch_sampler = _timed(totals, "sampler_launch", runner.launch_sampler)
    engine._record = _timed(totals, "record", engine._record)  # update + device wait
    engine._launch = _timed(totals, "launch", engine._launch)  # rows + both launches
    if not _CURRENT:
        _CURRENT.append(totals)
        build = model_runner.build_sampling_metadata
        model_runner.build_sampling_metadata = lambda *a, **k: _timed(
            _CURRENT[0], "sampling_md", build)(*a, **k)
    _CURRENT[0] = totals


def make_engine(num_seqs: int, context: int, steps: int, prefix_caching: bool,
                async_scheduling: bool, attention_backend: str = "reference"):
    from jaxllm import EngineConfig, LLMEngine, load_model
    from jaxllm.model_config import ModelConfig

    # One layer, one KV head: the device's share of a step stays small next to the host's.
    cfg = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, max_position_embeddings=8 * context + 1024,
                      eos_token_ids=(1,))
    model = load_model(config=cfg, load_format="dummy", dtype="float32")
    # The prompts' scheduling decodes the early ones meanwhile (``fill_batch``): room for that.
    max_len = context + steps + -(-num_seqs * context // 8192) + 64
    block_size = 16
    blocks = num_seqs * -(-max_len // block_size) + 64
    return LLMEngine(EngineConfig(
        max_num_seqs=num_seqs, max_num_batched_tokens=8192, max_model_len=max_len,
        block_size=block_size, num_gpu_blocks_override=blocks, swap_space=0,
        enforce_eager=True, compilation_cache_dir=None, async_scheduling=async_scheduling,
        enable_prefix_caching=prefix_caching, attention_backend=attention_backend, seed=0),
        model=model, progress=False)


def fill_batch(engine, num_seqs: int, context: int) -> None:
    """Queues ``num_seqs`` requests and schedules their prompts without running a model: each
    sample row gets a sampled-looking token, as ``_record`` would (the early requests decode
    while the later prompts are scheduled, as they would in a real run)."""
    from jaxllm import SamplingParams

    rng = np.random.default_rng(0)
    shared = rng.integers(2, 250, context // 2).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)  # to the end
    for i in range(num_seqs):
        prompt = shared + rng.integers(2, 250, context - len(shared)).tolist()
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                               for g in sched.running for s in g.seqs):
        out = sched.schedule()
        for row in out.sample_rows:
            row.seq.token_ids.append(int(rng.integers(2, 250)))


def measure(args, num_seqs: int, prefix_caching: bool, gc_timer: GcTimer) -> dict:
    total_steps = args.warm_steps + args.steps + args.profile_steps
    engine = make_engine(num_seqs, args.context, total_steps, prefix_caching,
                         args.mode == "async", args.attention_backend)
    engine.stream_outputs = False  # offline: outputs only for finished requests
    fill_batch(engine, num_seqs, args.context)
    totals: collections.Counter = collections.Counter()
    instrument(engine, totals)
    for _ in range(args.warm_steps):  # compiles the decode bucket(s)
        engine.step()
    if args.gc_freeze:  # what lives now is never collected (vLLM freezes after start-up)
        gc.collect()
        gc.freeze()
    totals.clear()
    stats = engine.stats
    update0, wait0, steps0 = stats.update_seconds, stats.device_wait_seconds, stats.num_steps
    per_step = []
    gc_timer.reset()
    gc_timer.on = True
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        per_step.append(time.perf_counter() - start)
    gc_timer.on = False
    steps = stats.num_steps - steps0
    totals["update"] = stats.update_seconds - update0
    totals["update_cpu"] = totals["record_cpu"]  # blocked on the device: no CPU time
    for suffix in ("", "_cpu"):
        totals["transfer" + suffix] = (totals["prepare" + suffix] - totals["pack" + suffix]
                                       - totals["moves" + suffix])
        totals["sampler_rows" + suffix] = (totals["launch" + suffix]
                                           - totals["forward_launch" + suffix]
                                           - totals["sampler_launch" + suffix])
        totals["sampler_launch" + suffix] -= totals["sampling_md" + suffix]  # shown apart
    ms = {p: 1e3 * totals[p] / steps for p in PHASES}
    cpu_ms = {p: 1e3 * totals[p + "_cpu"] / steps for p in PHASES}
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.profile_steps):
        engine.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
    while engine.has_unfinished_requests():  # drain, so the engine ends clean
        engine.abort_request(list(engine._groups))
        engine.step()
    gc.unfreeze()
    return {"num_seqs": num_seqs, "prefix_caching": prefix_caching, "steps": steps,
            "host_ms": round(sum(ms.values()), 3), "host_cpu_ms": round(sum(cpu_ms.values()), 3),
            "phase_ms": {k: round(v, 3) for k, v in ms.items()},
            "phase_cpu_ms": {k: round(v, 3) for k, v in cpu_ms.items()},
            "gc_ms": round(1e3 * gc_timer.seconds / steps, 3),
            "gc_collections": gc_timer.collections,
            # Per generation 0, 1, 2: collections in the timed steps, and ms a step in them.
            "gc_by_generation": [[n, round(1e3 * sec / steps, 3)]
                                 for n, sec in gc_timer.by_generation],
            "step_wall_ms_median": round(1e3 * float(np.median(per_step)), 3),
            "device_wait_ms": round(1e3 * (stats.device_wait_seconds - wait0) / steps, 3),
            "profile_top": _top_lines(text.getvalue(), args.top)}


def _top_lines(text: str, top: int) -> list[str]:
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if line.strip().startswith("ncalls")), 0)
    return [line.rstrip() for line in lines[head:head + top + 1] if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens a sequence")
    parser.add_argument("--prefix-caching", choices=["off", "on"], nargs="+",
                        default=["off", "on"])
    parser.add_argument("--mode", choices=["async", "sync"], default="async")
    # The tiny model's attention is not what is measured: the reference runs on any backend
    # (its block tables are padded to a power of two; "pallas" pads them to max_model_len).
    parser.add_argument("--attention-backend", default="reference")
    parser.add_argument("--warm-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=15, help="cProfile rows printed")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() once the batch runs: the collector skips it")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    import jax
    from jaxllm.benchmarks.provenance import source_commit, write_json

    gc_timer = GcTimer()
    runs = [measure(args, n, caching == "on", gc_timer) for n in args.num_seqs
            for caching in args.prefix_caching]
    for kind, key, total in (("wall", "phase_ms", "host_ms"), ("thread CPU", "phase_cpu_ms",
                                                               "host_cpu_ms")):
        print(f"\nms a step, {kind}:")
        print(f"{'seqs':>5} {'cache':>5} " + " ".join(f"{p:>14}" for p in PHASES)
              + f" {'host':>8} {'step':>8} {'gc':>6}")
        for r in runs:
            print(f"{r['num_seqs']:5d} {'on' if r['prefix_caching'] else 'off':>5} "
                  + " ".join(f"{r[key][p]:14.3f}" for p in PHASES)
                  + f" {r[total]:8.2f} {r['step_wall_ms_median']:8.2f} {r['gc_ms']:6.2f}")
    print("\ngarbage collections in the timed steps, per generation 0/1/2 (count, ms a step):")
    for r in runs:
        print(f"{r['num_seqs']:5d} {'on' if r['prefix_caching'] else 'off':>5} "
              + "  ".join(f"gen{g}: {n} {ms:.2f}" for g, (n, ms)
                          in enumerate(r["gc_by_generation"])))
    for r in runs:
        print(f"\ncProfile, {r['num_seqs']} seqs, prefix caching "
              f"{'on' if r['prefix_caching'] else 'off'} ({args.profile_steps} steps):")
        print("\n".join(r["profile_top"]))
    record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "commit": source_commit(), "backend": jax.default_backend(),
              "args": vars(args), "runs": runs}
    write_json(record, args.output_json)
    if args.output_json:
        print(f"\nwrote {args.output_json}")
    else:
        print(json.dumps({"runs": [{k: v for k, v in r.items() if k != "profile_top"}
                                   for r in runs]}))


if __name__ == "__main__":
    main()
