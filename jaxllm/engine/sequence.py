"""Request state: a ``SequenceGroup`` per user request, one ``Sequence`` per sample (n > 1).

Plain Python, no ``jax``. Every sequence has ``num_computed_tokens`` (tokens whose K/V are
in the pool) catching up with ``num_tokens`` (prompt + output); the scheduler only ever
decides how many of the missing tokens to compute next.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from jaxllm.sampling_params import SamplingParams

PLACEHOLDER_TOKEN = -1  # a token being sampled on the device right now


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_IGNORED = "ignored"  # rejected: can never be scheduled

    @property
    def is_finished(self) -> bool:
        # A set lookup by name (its str hash is cached): this runs for every sequence every
        # step, and Enum.__hash__ is Python (this property: 306 -> 163 ns on the 2-core host).
        return self._name_ in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


_FINISHED = frozenset(s.name for s in SequenceStatus if s.name.startswith("FINISHED"))


class Sequence:
    """One token stream. Its prompt list is shared (never copied) with its siblings."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], index: int = 0, seed: int = 0):
        self.seq_id = seq_id
        self.index = index  # sample index within the request (0..n-1)
        self.seed = seed
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        self.stopped_by_token = False  # its last token is the EOS or stop token id that ended it
        self.logprobs: list[dict[int, float]] = []  # per output token, when requested
        self.cumulative_logprob = 0.0
        self.detokenizer: Any = None  # set by the engine when the model has a tokenizer
        # Output tokens allowed (max_tokens, and what max_model_len leaves after the prompt).
        self.output_limit = 1 << 62
        # Async scheduling: positions of tokens still being sampled on the device -> their
        # row in the step that samples them. token_ids holds PLACEHOLDER_TOKEN there.
        self.pending: dict[int, int] = {}
        self.num_sent_tokens = 0  # output tokens already in a delta output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def known_output_token_ids(self) -> list[int]:
        """Output tokens without the placeholders still being sampled on the device."""
        return self.token_ids[len(self.prompt_token_ids):len(self.token_ids) - len(self.pending)]

    def take_new_output_token_ids(self) -> list[int]:
        """Known output tokens not yet in a delta output (and marks them sent)."""
        start = len(self.prompt_token_ids) + self.num_sent_tokens
        new = self.token_ids[start:self.num_known_tokens]
        self.num_sent_tokens += len(new)
        return new

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows (placeholders excluded)."""
        return len(self.token_ids) - len(self.pending)

    @property
    def reached_output_limit(self) -> bool:
        return self.num_output_tokens >= self.output_limit

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def fork(self, seq_id: int, index: int, seed: int) -> Sequence:
        child = Sequence(seq_id, self.prompt_token_ids, index, seed)
        child.token_ids = list(self.token_ids)
        child.output_limit = self.output_limit
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        return child

    def reset_for_recompute(self) -> None:
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


class SequenceGroup:
    """A user request: its sampling params and its sequences (one until the prompt is done)."""

    def __init__(self, request_id: str, seqs: list[Sequence], params: SamplingParams,
                 arrival_time: float | None = None, priority: int = 0,
                 reads_every_position: bool = False):
        self.request_id = request_id
        self.seqs = seqs
        self.params = params
        self.priority = priority
        # Computes every prompt position itself, never from the prefix cache (mean pooling
        # reads each position's hidden state, which the cache does not keep).
        self.reads_every_position = reads_every_position
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None
                                      else time.monotonic())
        self.num_preemptions = 0

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.is_finished]

    def seqs_with_status(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status == status]

    @property
    def is_finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

    @property
    def needs_fork(self) -> bool:
        """Parallel sampling forks once, when the single prompt sequence is about to sample."""
        return self.params.n > len(self.seqs)

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={self.seqs})"
