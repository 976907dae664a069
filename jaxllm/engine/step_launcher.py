"""A step's device side: launch it, then wait for it and record the tokens it sampled.

:meth:`LLMEngine.step <jaxllm.engine.llm_engine.LLMEngine.step>` orders these stages so that
one step stays in flight while the host works (its docstring draws the timeline); this module
owns what each stage does. ``_launch``: the forward, and the sampler unless a row is under a
grammar; ``_finish_launch``: such a step's sampler, once its bitmask is filled; ``_record``:
the wait, the tokens into their sequences, and the grammar work started on the bitmask thread.
Apart from the engine's file, which keeps construction, the request API and output building,
because this is the one part that handles a step between its schedule and its outputs.

A mixin rather than functions: the stages work on the engine's parts (annotated on the
class), and the benchmarks time ``_launch`` and ``_record`` by wrapping them on an instance.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from jaxllm.engine.sequence import PLACEHOLDER_TOKEN, SequenceStatus

if TYPE_CHECKING:
    from jaxllm.engine.block_manager import BlockManager
    from jaxllm.engine.embeddings import EmbeddingRequests
    from jaxllm.engine.model_runner import ModelRunner
    from jaxllm.engine.output_processor import OutputProcessor
    from jaxllm.engine.sampler_table import SamplerTable
    from jaxllm.engine.scheduler import Scheduler, SchedulerOutput
    from jaxllm.engine.stats import EngineStats
    from jaxllm.engine.step_handles import (
        LaunchedForward,
        PendingStep,
        PreparedForward,
        StepResult,
    )
    from jaxllm.sampler_rows import SamplerBatch
    from jaxllm.structured import GrammarTask, StructuredOutputs


@dataclasses.dataclass
class _LaunchedStep:
    """A launched step whose tokens are not recorded yet."""

    out: SchedulerOutput
    rows: SamplerBatch  # out.sample_rows as sampler rows
    constrained: list[int]  # sample rows under a grammar
    positions: list[int] = dataclasses.field(default_factory=list)  # each row's token position
    pending: PendingStep | None = None  # None until the sampler is launched
    forward: LaunchedForward | None = None  # constrained: the forward awaiting its sampler
    grammar: GrammarTask | None = None  # constrained: its bitmask being filled


class StepLauncher:
    """Mixed into :class:`~jaxllm.engine.llm_engine.LLMEngine`; uses these of its parts."""

    runner: ModelRunner
    sampler_table: SamplerTable
    structured: StructuredOutputs | None
    embeddings: EmbeddingRequests
    output_processor: OutputProcessor
    scheduler: Scheduler
    block_manager: BlockManager
    stats: EngineStats

    def _launch(self, out: SchedulerOutput, prepared: PreparedForward,
                prev: PendingStep | None) -> _LaunchedStep:
        """Launches a scheduled step: all of it, or only its forward when a row is
        constrained (the sampler waits for the bitmask)."""
        samples = out.sample_rows
        rows = self.sampler_table.batch(samples)
        constrained = self.sampler_table.constrained(samples) if rows.variant.use_bitmask \
            else []
        step = _LaunchedStep(out, rows, constrained,
                             forward=self.runner.launch_forward(prepared, prev))
        if not constrained:
            step.pending, step.forward = self.runner.launch_sampler(step.forward, rows), None
        positions = step.positions
        for r, row in enumerate(samples):  # their ids are known after the step
            tokens = row.seq.token_ids
            positions.append(len(tokens))
            row.seq.pending[len(tokens)] = r
            tokens.append(PLACEHOLDER_TOKEN)
        return step

    def _finish_launch(self, step: _LaunchedStep) -> None:
        """Launches a constrained step's sampler once its bitmask is filled."""
        if step.pending is not None:
            return
        task, step.grammar = step.grammar, None
        if task is None:  # sync scheduling: nothing was started for it
            task, _ = self._start_grammar(None, None, step)
        bitmask = self.structured.result(task, self.stats)
        step.pending = self.runner.launch_sampler(step.forward, step.rows, bitmask)
        step.forward = None

    def _record(self, step: _LaunchedStep, following: _LaunchedStep | None = None) -> None:
        """Waits for a launched step and records its tokens (text waits for
        ``_emit_outputs``). Their grammar work starts at once on the bitmask thread, and
        then ``following``'s bitmask, which its sampler takes."""
        out, positions = step.out, step.positions
        t0 = time.perf_counter()
        result = step.pending.wait()
        t1 = time.perf_counter()
        task, fed = self._start_grammar(step, result, following) if step.constrained or (
            following is not None and following.constrained) else (None, [])
        embeddings = self.embeddings
        embeddings.record(out, result)
        num_embedded = 0
        with_embeddings = embeddings.in_step(out)
        if not with_embeddings:  # every row a token: the batched path
            self.output_processor.fill_tokens(out.sample_rows, result, positions)
        for r, row in enumerate(out.sample_rows if with_embeddings else ()):
            seq = row.seq
            if seq.seq_id in embeddings:  # an embedding request: no token, it is done
                seq.pending.pop(positions[r], None)
                del seq.token_ids[positions[r]:]
                embeddings.finish(seq.seq_id, result, r, seq.num_prompt_tokens)
                self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
                num_embedded += 1
            else:
                self.output_processor.fill_token(seq, row.group, result, r, positions[r])
        # Before the grammars' answer, to give their accepts more time (a sequence that its
        # grammar stops now is counted as running this step: it was).
        self.stats.account(out, num_embedded, self.block_manager, self.scheduler.running)
        if task is not None:
            for i in self.structured.accepted(task, self.stats):  # their grammar is complete
                r = fed[i]
                self.output_processor.finish_grammar(out.sample_rows[r].seq, positions[r])
            if following is not None and following.constrained:
                following.grammar = task
            else:
                self.structured.result(task, self.stats)
        stats = self.stats
        stats.num_steps += 1
        stats.device_wait_seconds += t1 - t0
        stats.update_seconds += time.perf_counter() - t1

    def _start_grammar(self, fed: _LaunchedStep | None, result: StepResult | None,
                       following: _LaunchedStep | None) -> tuple[GrammarTask | None, list[int]]:
        """Starts the grammar task: ``fed``'s tokens into its constrained rows' grammars, then
        the bitmask of ``following``'s constrained rows; returns it and the rows fed (what
        ``accepted`` indexes). Sequences that finished before (abort, stop string) are left
        out; one that finishes with ``fed``'s token still gets a (wasted) mask row."""
        rows = [] if fed is None else [r for r in fed.constrained
                                       if not fed.out.sample_rows[r].seq.status.is_finished]
        need_mask = following is not None and following.constrained and following.pending is None
        if not rows and not need_mask:
            return None, rows
        tokens = result.sampled[rows].tolist() if rows else []
        fill = [] if not need_mask else [r for r in following.constrained if not
                                         following.out.sample_rows[r].seq.status.is_finished]
        samples = [fed.out.sample_rows[r] for r in rows]
        filled = [following.out.sample_rows[r] for r in fill]

        # A matcher not made yet is made on the bitmask thread from the outputs before the
        # row's token; the engine thread writes only at or after that position meanwhile.
        def missing(i: int):
            seq = samples[i].seq
            return samples[i].group.params.structured_outputs, \
                seq.token_ids[seq.num_prompt_tokens:fed.positions[rows[i]]]

        def fill_missing(j: int):
            seq = filled[j].seq
            return filled[j].group.params.structured_outputs, \
                seq.token_ids[seq.num_prompt_tokens:following.positions[fill[j]]]

        return self.structured.start_step(
            [s.seq.seq_id for s in samples], tokens, missing, fill, [s.seq.seq_id for s in filled],
            fill_missing, following.forward.shape.num_seqs if need_mask else 0, self.stats), rows

