"""Per-sequence grammar state and each step's token bitmask (host side, no jax).

The engine keeps one matcher per constrained sequence (n > 1: one per sample), fed every token
the sequence samples. Before a step's sampler runs, ``fill(jobs(...))`` writes the allowed tokens
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

# A sequence's constraint and its output tokens so far, asked for only when its matcher has to
# be made: missing(i) for the i-th sequence of a call.
# Above this many rows a step's accepts go to llguidance's pool in one call. On the H200 host
# (16 cores) one call per row took 0.40 ms for 64 rows against 0.55 in parallel, and 1.89 ms
# for 256 rows against 1.37 (benchmarks/constrained_step.py).
PARALLEL_ACCEPT_ROWS = 128
Missing = Callable[[int], tuple[StructuredOutputsParams, Sequence[int]]]


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

    def _matchers_of(self, seq_ids: Sequence[int], missing: Missing) -> list:
        """The matchers of ``seq_ids``; one not made yet is made from ``missing(i)`` (the
        i-th sequence's constraint and its output tokens so far: a fork, a restart) and
        catches up on those tokens."""
        found = list(map(self._matchers.get, seq_ids))
        if None in found:
            import llguidance

            for i, matcher in enumerate(found):
                if matcher is None:
                    spec, done = missing(i)
                    matcher = llguidance.LLMatcher(self.compiler.ll_tokenizer,
                                                   self.compiler.compile(spec))
                    if done:
                        matcher.consume_tokens(list(done))
                    self._matchers[seq_ids[i]] = found[i] = matcher
        return found

    def jobs(self, rows: Sequence[int], seq_ids: Sequence[int], missing: Missing) -> list:
        """(matcher, row) for each constrained row, the fill's input. Engine thread."""
        return list(zip(self._matchers_of(seq_ids, missing), rows, strict=True))

    def start_fill(self, rows: Sequence[int], seq_ids: Sequence[int], missing: Missing,
                   num_rows: int, stats: Any) -> concurrent.futures.Future:
        """Starts filling the bitmask (i32[num_rows, W]) of ``rows`` (sequences ``seq_ids``)
        on the bitmask thread; the matchers are looked up (or made) here, on the engine
        thread. ``stats`` (EngineStats) counts the engine thread's part in
        ``bitmask_seconds`` and the fill's in ``bitmask_fill_seconds``."""
        start = time.perf_counter()
        jobs = self.jobs(rows, seq_ids, missing)
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
        import llguidance.numpy

        bitmask = np.full((num_rows, self.width), -1, np.int32)
        if not jobs:
            return bitmask
        llguidance.numpy.fill_next_token_bitmask_par(self._llexecutor(), jobs, bitmask)
        return bitmask

    def accept(self, seq_ids: Sequence[int], tokens: Sequence[int],
               missing: Missing) -> list[int]:
        """Feeds each sequence its sampled token; returns the indices of those whose grammar
        is now complete (nothing may follow but EOS), so they can stop.

        NOTE: up to ``PARALLEL_ACCEPT_ROWS`` rows, one ``consume_token`` call each: llguidance's
        parallel call costs more than the rows' work there (benchmarks/RESULTS.md, "Issue 19:
        the constrained step's host cost on CPU")."""
        eos = self.compiler.eos_token_ids
        complete, feed = [], []
        for i, (matcher, token) in enumerate(zip(self._matchers_of(seq_ids, missing), tokens,
                                                 strict=True)):
            if matcher.is_stopped() or (token in eos and matcher.is_accepting()):
                complete.append(i)
            else:
                feed.append((i, matcher, token))
        if len(feed) > PARALLEL_ACCEPT_ROWS:
            consumed = self._llexecutor().consume_token_par([(m, t) for _, m, t in feed])
        else:
            consumed = [matcher.consume_token(token) for _, matcher, token in feed]
        for (i, matcher, token), ok in zip(feed, consumed, strict=True):
            if not ok:
                # Only possible if the token bypassed the mask; the output so far stands.
                logger.warning("sequence %d: token %d rejected by its grammar: %s",
                               seq_ids[i], token, matcher.get_error()[:300])
            if not ok or matcher.is_stopped():
                complete.append(i)
        return sorted(complete)

    def _llexecutor(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    def free(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
