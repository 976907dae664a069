"""Per-sequence grammar state and each step's token bitmask (host side, no jax).

The engine keeps one matcher per constrained sequence (n > 1: one per sample), fed every token
the sequence samples. Before a step's sampler runs, ``fill(jobs(rows))`` writes the allowed tokens
of its constrained rows (llguidance fills rows in parallel, outside the GIL); unconstrained
rows stay all-ones. Matchers are made on first use from the request's compiled grammar and
catch up on tokens already generated, so forks and preempted sequences need no special case.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

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

    def fill(self, jobs: list, num_rows: int) -> np.ndarray:
        """Fills the jobs' rows (llguidance works outside the GIL, on its own threads), so it
        may run beside the engine thread as long as that thread leaves these matchers be."""
        import llguidance
        import llguidance.numpy

        bitmask = np.full((num_rows, self.width), -1, np.int32)
        if not jobs:
            return bitmask
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, jobs, bitmask)
        return bitmask

    def accept(self, seq_id: int, spec: StructuredOutputsParams, token: int,
               output_token_ids: Callable[[], Sequence[int]]) -> bool:
        """Feeds a sampled token to the sequence's matcher; True when the grammar is complete
        (nothing may follow but EOS), so the sequence can stop. ``output_token_ids`` are the
        tokens before ``token`` (used only if the matcher has to be made)."""
        matcher = self._matcher(seq_id, spec, output_token_ids)
        if matcher.is_stopped():
            return True
        if token in self.compiler.eos_token_ids and matcher.is_accepting():
            return True
        if not matcher.consume_token(token):
            # Only possible if the token bypassed the mask; the output so far stands.
            logger.warning("sequence %d: token %d rejected by its grammar: %s", seq_id, token,
                           matcher.get_error()[:300])
            return True
        return matcher.is_stopped()

    def free(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
