"""What the engine returns per request, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

import dataclasses

from jaxllm.engine.sequence import RequestMetrics, SequenceGroup


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per token: chosen + top-k ids -> logprob
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    @classmethod
    def from_group(cls, group: SequenceGroup, prompt: str | None) -> RequestOutput:
        want_logprobs = group.params.logprobs is not None
        outputs = []
        for seq in sorted(group.seqs, key=lambda s: s.index):
            text = seq.detokenizer.output_text if seq.detokenizer is not None else ""
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.known_output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
                logprobs=list(seq.logprobs) if want_logprobs else None,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
        return cls(group.request_id, prompt, group.prompt_token_ids, outputs,
                   group.is_finished and len(group.seqs) >= group.params.n or
                   (group.is_finished and any(s.status.finish_reason == "abort"
                                              for s in group.seqs)),
                   group.metrics, group.metrics.num_cached_tokens)


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]  # f32[H], unit length when the pooling params normalize


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """What an embedding request returns (vLLM's name); one output, when it finishes.
    ``outputs`` is None when the request was aborted."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    finish_reason: str | None = None  # "stop" (embedded) | "abort"
