"""Embedding requests in the engine: a prompt scheduled like any other (chunked prefill,
priorities, preemption), whose last chunk's sample row yields the embedding instead of a
token. Plain Python and numpy; the device pools each step (``StepResult.pooled_*``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput
from jaxllm.engine.scheduler import SchedulerOutput
from jaxllm.engine.sequence import SequenceGroup
from jaxllm.engine.step_handles import StepResult
from jaxllm.pooling_params import PoolingParams, finish_embedding


@dataclasses.dataclass
class _Pooling:
    params: PoolingParams
    request_id: str
    total: np.ndarray | None = None  # MEAN: the sum of the hidden states computed so far


class EmbeddingRequests:
    """The engine's embedding requests: those being computed (by sequence id) and those
    whose embedding is ready (by request id) until their output is built."""

    def __init__(self) -> None:
        self._seqs: dict[int, _Pooling] = {}
        self._requests: dict[str, np.ndarray | None] = {}

    def add(self, request_id: str, seq_id: int, params: PoolingParams) -> None:
        self._seqs[seq_id] = _Pooling(params, request_id)
        self._requests[request_id] = None

    def is_embedding(self, request_id: str) -> bool:
        return request_id in self._requests

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def in_step(self, out: SchedulerOutput) -> bool:
        """Whether the step computes a chunk of an embedding request (it must pool)."""
        return bool(self._seqs) and any(item.seq.seq_id in self._seqs for item in out.scheduled)

    def record(self, out: SchedulerOutput, result: StepResult) -> None:
        """Adds each MEAN request's chunk sum; a chunk from position 0 starts over (the
        request was preempted and is recomputed)."""
        if not self._seqs:
            return
        for i, item in enumerate(out.scheduled):
            state = self._seqs.get(item.seq.seq_id)
            if state is None or state.params.pooling_type != "MEAN":
                continue
            chunk = result.pooled_sums[i]
            state.total = chunk.copy() if item.start == 0 or state.total is None \
                else state.total + chunk

    def finish(self, seq_id: int, result: StepResult, row: int, num_prompt_tokens: int) -> None:
        """Computes the embedding of a request whose last prompt chunk was sample row
        ``row``."""
        state = self._seqs.pop(seq_id)
        self._requests[state.request_id] = finish_embedding(
            state.params, result.pooled_last[row], state.total, num_prompt_tokens)

    def output(self, group: SequenceGroup, prompt: str | None) -> EmbeddingRequestOutput:
        """The finished (or aborted) request's output; forgets the request."""
        for seq in group.seqs:
            self._seqs.pop(seq.seq_id, None)
        vector = self._requests.pop(group.request_id)
        return EmbeddingRequestOutput(
            group.request_id, prompt, group.prompt_token_ids,
            None if vector is None else EmbeddingOutput(vector.tolist()), True, group.metrics,
            group.metrics.num_cached_tokens, "abort" if vector is None else "stop")
