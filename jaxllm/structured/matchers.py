"""Per-sequence grammar state and each step's token bitmask (host side, no jax).

The engine keeps one matcher per constrained sequence (n > 1: one per sample), fed every token
the sequence samples. Before a step's sampler runs, ``fill(jobs(rows))`` writes the allowed tokens
of its constrained rows (llguidance fills rows in parallel, outside the GIL); unconstrained
rows stay all-ones. Matchers are made on first use from the request's compiled grammar and
catch up on tokens already generated, so forks and preempted sequences need no special case.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class StructuredOutputs:
    """The engine's structured-output state: a compiler and the live matchers."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.width = bitmask_width(compiler.vocab_size)
        self._matchers: dict[int, object] = {}  # seq_id -> llguidance.LLMatcher
        self._executor = None
        self._fill_thread = concurrent.futures.ThreadPoolExecutor(1, "jaxllm-bitmask")

    def compile(self, spec: StructuredOutputsParams) -> str:
        return self.compiler.compile(spec)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def _matcher(self, seq_id: int, spec: StructuredOutputsParams,
                 output_token_ids: Callable[[], Sequence[int]]):
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            import llguidance

            matcher = llguidance.LLMatcher(self.compiler.ll_tokenizer,
                                           self.compiler.compile(spec))
            done = list(output_token_ids())
            if done:
                matcher.consume_tokens(done)
            self._matchers[seq_id] = matcher
        return matcher

    def jobs(self, rows: Sequence[tuple[int, int, StructuredOutputsParams,
                                        Callable[[], Sequence[int]]]]) -> list:
        """The matchers of ``rows`` (row, seq_id, spec, the output tokens so far), made where
        missing (the tokens are asked for only then: a fork, a restart). Engine thread."""
        return [(self._matcher(seq_id, spec, outputs), row)
                for row, seq_id, spec, outputs in rows]

    def start_fill(self, rows: Sequence[tuple[int, int, StructuredOutputsParams,
                                              Callable[[], Sequence[int]]]],
                   num_rows: int, stats: Any) -> concurrent.futures.Future:
        """Starts filling ``rows``' bitmask (i32[num_rows, W]) on the bitmask thread; the
        matchers are looked up (or made) here, on the engine thread. ``stats`` (EngineStats)
        counts the engine thread's part in ``bitmask_seconds`` and the fill's in
        ``bitmask_fill_seconds``."""
        start = time.perf_counter()
        jobs = self.jobs(rows)
        stats.bitmask_seconds += time.perf_counter() - start

        def fill() -> np.ndarray:
            begin = time.perf_counter()
            bitmask = self.fill(jobs, num_rows)
            stats.bitmask_fill_seconds += time.perf_counter() - begin
            return bitmask

        future = self._fill_thread.submit(fill)
        # Hand the GIL over now: the fill thread needs it only to enter llguidance (which then
        # releases it), and would otherwise wait out the switch interval behind the
        # detokenization that runs next on the engine thread.
        time.sleep(0)
        return future

    def fill(self, jobs: list, num_rows: int) -> np.ndarray:
        """Fills the jobs' rows (llguidance works outside the GIL, on its own threads), so it
        may run beside the engine thread as long as that thread leaves these matchers be."""
        import llguidance
        import llguidance.numpy

        bitmask = np.full((num_rows, self.width), -1, np.int32)
        if not jobs:
            return bitmask
        llguidance.numpy.fill_next_token_bitmask_par(self._llexecutor(), jobs, bitmask)
        return bitmask

    def accept(self, rows: Sequence[tuple[int, StructuredOutputsParams, int,
                                          Callable[[], Sequence[int]]]]) -> list[bool]:
        """Feeds each row's sampled token to its sequence's matcher, all rows at once (in
        parallel, outside the GIL); per row, True when the grammar is complete (nothing may
        follow but EOS), so the sequence can stop. A row is (seq_id, spec, token, the output
        tokens before ``token``: used only if the matcher has to be made)."""
        complete = [False] * len(rows)
        feed = []
        for i, (seq_id, spec, token, outputs) in enumerate(rows):
            matcher = self._matcher(seq_id, spec, outputs)
            if matcher.is_stopped() or (token in self.compiler.eos_token_ids
                                        and matcher.is_accepting()):
                complete[i] = True
            else:
                feed.append((i, seq_id, matcher, token))
        if not feed:
            return complete
        consumed = self._llexecutor().consume_token_par([(m, t) for _, _, m, t in feed])
        for (i, seq_id, matcher, token), ok in zip(feed, consumed, strict=True):
            if not ok:
                # Only possible if the token bypassed the mask; the output so far stands.
                logger.warning("sequence %d: token %d rejected by its grammar: %s", seq_id,
                               token, matcher.get_error()[:300])
            complete[i] = not ok or matcher.is_stopped()
        return complete

    def _llexecutor(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    def free(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
