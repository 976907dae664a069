"""What the engine returns per request, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

import dataclasses

from jaxllm.engine.sequence import RequestMetrics, SequenceGroup
from jaxllm.sampling_params import RequestOutputKind


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
        """The group's output now, whole or (``output_kind`` DELTA) only what is new since
        its previous output: then each call costs what is new, not the output's length."""
        want_logprobs = group.params.logprobs is not None
        delta = group.params.output_kind is RequestOutputKind.DELTA
        outputs = []
        for seq in sorted(group.seqs, key=lambda s: s.index):
            detok = seq.detokenizer
            if delta:
                start = seq.num_sent_tokens
                token_ids = seq.take_new_output_token_ids()
                text = detok.take_new_text() if detok is not None else ""
                logprobs = seq.logprobs[start:start + len(token_ids)] if want_logprobs else None
            else:
                token_ids = seq.known_output_token_ids
                text = detok.output_text if detok is not None else ""
                logprobs = list(seq.logprobs) if want_logprobs else None
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=token_ids,
                cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
                logprobs=logprobs, finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason))
        return cls(group.request_id, prompt, group.prompt_token_ids, outputs,
                   group.is_finished and len(group.seqs) >= group.params.n or
                   (group.is_finished and any(s.status.finish_reason == "abort"
                                              for s in group.seqs)),
                   group.metrics, group.metrics.num_cached_tokens)


    def merge(self, newer: RequestOutput) -> RequestOutput:
        """This delta output followed by ``newer`` (the next delta of the same request), as
        one delta: what a consumer that fell behind receives instead of both."""
        mine = {o.index: o for o in self.outputs}
        merged = []
        for out in newer.outputs:
            old = mine.pop(out.index, None)
            if old is not None:
                logprobs = None if out.logprobs is None else (old.logprobs or []) + out.logprobs
                out = dataclasses.replace(out, text=old.text + out.text,
                                          token_ids=old.token_ids + out.token_ids,
                                          logprobs=logprobs)
            merged.append(out)
        merged += mine.values()  # a sample absent from newer keeps its last delta
        merged.sort(key=lambda o: o.index)
        return dataclasses.replace(newer, outputs=merged)


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
