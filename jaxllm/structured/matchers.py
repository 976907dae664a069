"""Per-sequence grammar state and each step's token bitmask (host side, no jax).

The engine keeps one matcher per constrained sequence (n > 1: one per sample), fed every token
the sequence samples. A step's grammar work runs on the bitmask thread as one task
(``start_step``): feed the constrained rows the tokens just sampled, then fill the allowed
tokens of the next step's constrained rows (unconstrained rows stay all-ones). Both are
llguidance calls that run outside the GIL on its own threads, so the task overlaps the engine
thread's Python. Matchers are made on first use from the request's compiled grammar and
catch up on tokens already generated, so forks and preempted sequences need no special case.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

# A sequence's constraint and its output tokens so far, asked for only when its matcher has to
# be made: missing(i) for the i-th sequence of a call.
Missing = Callable[[int], tuple[StructuredOutputsParams, Sequence[int]]]
INITIAL_MATCHERS = 64  # distinct grammars whose fresh matcher is kept for copying


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class GrammarTask:
    """A step's grammar work under way on the bitmask thread (``StructuredOutputs.start_step``):
    ``accepted`` and ``result`` wait for its two halves."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.accepted = threading.Event()
        self.complete: list[int] = []  # set before ``accepted``
        self.future: concurrent.futures.Future | None = None


class StructuredOutputs:
    """The engine's structured-output state: a compiler and the live matchers.

    Threads: the matchers are touched only by the bitmask thread while a step task is under
    way (``start_step`` .. ``result``), and by the caller's thread otherwise; a ``free`` that
    arrives meanwhile is applied when the task's result is taken."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.width = bitmask_width(compiler.vocab_size)
        self._matchers: dict[int, object] = {}  # seq_id -> llguidance.LLMatcher
        self._executor = None
        self._fill_thread = concurrent.futures.ThreadPoolExecutor(1, "jaxllm-bitmask")
        self._tasks = 0  # step tasks started and not yet taken by ``result``
        self._freed: list[int] = []  # freed while a task ran
        # All-ones bitmasks made ready on the bitmask thread, by row count: numpy releases the
        # GIL while it writes 4 MB, and the thread would then wait out the engine's Python to
        # get it back in the middle of a step task.
        self._spare: dict[int, np.ndarray] = {}
        # A fresh matcher per grammar, copied for each new sequence: building one took 0.55 ms
        # for STRUCTURED_SCHEMA (benchmarks/jax_backends.py) on the dev host, a copy 1 us.
        self._initial: dict[str, object] = {}

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
                    grammar = self.compiler.compile(spec)
                    initial = self._initial.get(grammar)
                    if initial is None:
                        if len(self._initial) >= INITIAL_MATCHERS:
                            del self._initial[next(iter(self._initial))]  # the oldest
                        initial = self._initial[grammar] = llguidance.LLMatcher(
                            self.compiler.ll_tokenizer, grammar)
                    matcher = initial.deep_copy()
                    if done:
                        matcher.consume_tokens(list(done))
                    self._matchers[seq_ids[i]] = found[i] = matcher
        return found

    def jobs(self, rows: Sequence[int], seq_ids: Sequence[int], missing: Missing) -> list:
        """(matcher, row) for each constrained row, the fill's input."""
        return list(zip(self._matchers_of(seq_ids, missing), rows, strict=True))

    def start_step(self, seq_ids: Sequence[int], tokens: Sequence[int], missing: Missing,
                   fill_rows: Sequence[int], fill_seq_ids: Sequence[int],
                   fill_missing: Missing, num_rows: int, stats: Any) -> GrammarTask:
        """Starts a step's grammar work on the bitmask thread: feeds ``tokens[i]`` to
        sequence ``seq_ids[i]``'s grammar (``accepted``: the indices i whose grammar is now
        complete, nothing may follow but EOS), then fills the bitmask (i32[num_rows, W]; None
        when ``num_rows`` is 0) of ``fill_rows``, sequences ``fill_seq_ids`` whose grammars
        then have every token before the row's (``result``).

        Both are llguidance calls outside the GIL. This returns once the thread runs: the
        caller gives up the GIL until the thread enters llguidance, instead of making it wait
        out the switch interval (5 ms) behind its Python. ``stats`` (EngineStats) counts the
        caller's waits in ``bitmask_seconds``, the task's wall time in
        ``bitmask_fill_seconds``."""
        start = time.perf_counter()
        task = GrammarTask()
        self._tasks += 1
        task.future = self._fill_thread.submit(
            self._step, task, seq_ids, tokens, missing, fill_rows, fill_seq_ids, fill_missing,
            num_rows, stats)
        task.started.wait()
        stats.bitmask_seconds += time.perf_counter() - start
        return task

    def accepted(self, task: GrammarTask, stats: Any) -> list[int]:
        """Waits for a task's tokens to be in the grammars; the complete ones (indices)."""
        start = time.perf_counter()
        task.accepted.wait()
        stats.bitmask_seconds += time.perf_counter() - start
        return task.complete

    def result(self, task: GrammarTask, stats: Any) -> np.ndarray | None:
        """Waits for a task to end; its bitmask."""
        start = time.perf_counter()
        try:
            return task.future.result()
        finally:
            self._tasks -= 1
            if not self._tasks:
                for seq_id in self._freed:
                    self._matchers.pop(seq_id, None)
                self._freed.clear()
            stats.bitmask_seconds += time.perf_counter() - start

    def _step(self, task: GrammarTask, seq_ids, tokens, missing, fill_rows, fill_seq_ids,
              fill_missing, num_rows: int, stats) -> np.ndarray | None:
        """The bitmask thread's half of ``start_step``."""
        begin = time.perf_counter()
        try:
            # This thread holds the GIL: the caller takes it back when llguidance releases it.
            task.started.set()
            eos = self.compiler.eos_token_ids
            matchers = self._matchers_of(seq_ids, missing)
            complete, feed = [], []
            # (A stopped matcher is never fed: its sequence stopped when it stopped.)
            for i, (matcher, token) in enumerate(zip(matchers, tokens, strict=True)):
                if token in eos and matcher.is_accepting():
                    complete.append(i)
                else:
                    feed.append(i)
            # The fed rows' matchers exist now: only new sequences' are made here.
            jobs = list(zip(self._matchers_of(fill_seq_ids, fill_missing), fill_rows,
                            strict=True))
            bitmask = self._spare.pop(num_rows, None) if num_rows else None
            consumed = self._llexecutor().consume_token_par(
                [(matchers[i], tokens[i]) for i in feed]) if feed else []
            for i, ok in zip(feed, consumed, strict=True):
                if not ok:
                    # Only possible if the token bypassed the mask; the output so far stands.
                    logger.warning("sequence %d: token %d rejected by its grammar: %s",
                                   seq_ids[i], tokens[i], matchers[i].get_error()[:300])
                if not ok or matchers[i].is_stopped():
                    complete.append(i)
            task.complete = sorted(complete)
            if num_rows and bitmask is None:  # a new row count (the caller waits for this)
                bitmask = self._all_ones(num_rows)
        finally:
            task.started.set()
            task.accepted.set()
        if jobs:
            import llguidance.numpy

            llguidance.numpy.fill_next_token_bitmask_par(self._llexecutor(), jobs, bitmask)
        if num_rows:  # the next step's, made while the engine thread launches this one's
            self._fill_thread.submit(self._make_spare, num_rows)
        stats.bitmask_fill_seconds += time.perf_counter() - begin
        return bitmask

    def _all_ones(self, num_rows: int) -> np.ndarray:
        return np.full((num_rows, self.width), -1, np.int32)

    def _make_spare(self, num_rows: int) -> None:
        self._spare[num_rows] = self._all_ones(num_rows)

    def fill(self, jobs: list, num_rows: int) -> np.ndarray:
        """Fills the jobs' rows (llguidance works outside the GIL, on its own threads)."""
        import llguidance.numpy

        bitmask = self._all_ones(num_rows)
        if not jobs:
            return bitmask
        llguidance.numpy.fill_next_token_bitmask_par(self._llexecutor(), jobs, bitmask)
        return bitmask

    def _llexecutor(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    def free(self, seq_id: int) -> None:
        if self._tasks:  # the bitmask thread may be making this matcher right now
            self._freed.append(seq_id)
        else:
            self._matchers.pop(seq_id, None)
