"""Token deltas from the engine core, text and RequestOutputs in the front end (plain Python).

When the engine runs in its own process (``jaxllm serve``), its step loop does not
detokenize: each step it ships every progressing request's new token ids (and logprobs) as
one tuple (:func:`core_output`), and each front end turns those into text, applies stop
strings and builds the RequestOutputs its handlers read (:class:`RequestOutputProcessor`, as
vLLM V1's front-end OutputProcessor). Detokenizing costs a tokenizer call per token; on the
engine's thread it was on the host path of a host-bound step loop (RESULTS, issue 17).

A stop string found here ends its sequence here at once (its final output goes out now);
``process`` returns it so that the front end tells the core to stop the sequence too (freeing
its blocks). Tokens the core sampled past the stop meanwhile are dropped: never shown, never
counted. The in-process engine (``LLM``) keeps detokenizing in its own output path
(:meth:`jaxllm.engine.output_processor.OutputProcessor.detokenize`); both feed tokens one at a
time through :meth:`IncrementalDetokenizer.add_token`, so the text is the same.

The core's tuple for a generation request (the prompt fields: its first output only; the
metrics, fixed from the first token until the finish: its first and final outputs only)::

    (request_id, prompt | None, prompt_token_ids | None, finished,
     (arrival_time, first_scheduled_time, first_token_time, finished_time, num_cached_tokens)
       | None,
     [(index, new_token_ids, new_logprobs | None, cumulative_logprob | None,
       finish_reason | None, stop_reason, stopped_by_token), ...])   # one per sample

``stopped_by_token``: the sample's last token is the EOS or stop token id that ended it (its
text is left out unless ``include_stop_str_in_output``).
"""

from __future__ import annotations

import time
from typing import Any

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.outputs import CompletionOutput, RequestOutput
from jaxllm.engine.sequence import RequestMetrics, SequenceGroup
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

StopDecision = tuple[str, int, str]  # (request id, sample index, the stop string)
_RUNNING, _FINISHED, _STOPPED_HERE = 0, 1, 2  # what a core output did to a sample


def core_output(group: SequenceGroup, prompt: str | None) -> tuple:
    """The group's output tokens not yet sent, with each sample's finish, for the wire."""
    want_logprobs = group.params.logprobs is not None
    samples = []
    for seq in group.seqs:
        start = seq.num_sent_tokens
        ids = seq.take_new_output_token_ids()
        if ids or seq.status.is_finished:
            samples.append((seq.index, ids,
                            seq.logprobs[start:start + len(ids)] if want_logprobs else None,
                            seq.cumulative_logprob if want_logprobs else None,
                            seq.status.finish_reason, seq.stop_reason, seq.stopped_by_token))
    m = group.metrics
    finished = group.is_finished and (len(group.seqs) >= group.params.n or any(
        s.status.finish_reason == "abort" for s in group.seqs))
    return (group.request_id, prompt, group.prompt_token_ids, finished,
            (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time,
             m.num_cached_tokens), samples)


def needs_every_step(group: SequenceGroup, stream_outputs: bool) -> bool:
    """Whether the core sends this unfinished group's tokens every step (else only with its
    final output): when it streams, and when its front end searches stop strings."""
    params = group.params
    return bool(stream_outputs and params.output_kind is not RequestOutputKind.FINAL_ONLY
                or params.stop)


class _Sample:
    """One sample (sequence) of a request as the front end knows it."""

    __slots__ = ("index", "token_ids", "logprobs", "cumulative_logprob", "finish_reason",
                 "stop_reason", "detokenizer", "num_sent")

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer | None):
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = detokenizer
        self.num_sent = 0  # tokens already in a delta output


class RequestState:
    """A request in flight in this front end: its samples' tokens, text and finish."""

    def __init__(self, request_id: str, prompt: str | None,
                 prompt_token_ids: list[int] | None, params: SamplingParams):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.samples: dict[int, _Sample] = {}
        self.metrics: RequestMetrics | None = None

    @property
    def finished_here(self) -> bool:
        """Every sample has finished (some by a stop string the core has not heard of)."""
        return len(self.samples) >= self.params.n and all(
            s.finish_reason is not None for s in self.samples.values())


class RequestOutputProcessor:
    """The front end's half of the output path: core tuples in, RequestOutputs out."""

    def __init__(self, tokenizer: Any, stream_outputs: bool = True):
        self.tokenizer = tokenizer
        self.stream_outputs = stream_outputs  # False: final outputs only (LLM.generate)
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None,
                    prompt_token_ids: list[int] | None, params: SamplingParams) -> None:
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params)

    def forget(self, request_id: str) -> None:
        """The request ends without a final output from here (refused by the core)."""
        self.requests.pop(request_id, None)

    def process(self, items: list) -> tuple[list, list[StopDecision]]:
        """One core message's items into outputs (an embedding passes as it is), and the
        samples stopped here by a stop string, for the core to stop too."""
        outputs: list = []
        stops: list[StopDecision] = []
        for item in items:
            if type(item) is not tuple:
                outputs.append(item)
                continue
            output = self._process(item, stops)
            if output is not None:
                outputs.append(output)
        return outputs, stops

    def _process(self, item: tuple, stops: list[StopDecision]) -> RequestOutput | None:
        request_id, prompt, prompt_ids, finished, metrics, samples = item
        state = self.requests.get(request_id)
        if state is None:  # finished here already (a stop string): the core's late outputs
            return None
        if state.prompt_token_ids is None and prompt_ids is not None:
            state.prompt, state.prompt_token_ids = prompt, prompt_ids
        if metrics is not None:  # (every request's first output has them)
            state.metrics = RequestMetrics(*metrics)
        ended = False  # a sample finished with this item
        for sample in samples:
            how = self._update(state, *sample)
            if how == _STOPPED_HERE:
                stops.append((request_id, sample[0], state.samples[sample[0]].stop_reason))
            ended = ended or how != _RUNNING
        if not finished and ended and state.finished_here:
            finished = True
            state.metrics.finished_time = time.monotonic()
        if finished:
            del self.requests[request_id]
        elif not (self.stream_outputs
                  and state.params.output_kind is not RequestOutputKind.FINAL_ONLY):
            return None
        return self._output(state, finished)

    def _update(self, state: RequestState, index: int, ids: list[int],
                logprobs: list | None, cumulative: float | None, finish: str | None,
                stop_reason: int | str | None, stopped_by_token: bool) -> int:
        """Adds a sample's new tokens, one at a time through its detokenizer; returns
        _STOPPED_HERE when a stop string ended it (the tokens after the one that completed it
        are dropped), _FINISHED when the core's finish arrived, else _RUNNING."""
        sample = state.samples.get(index)
        if sample is None:
            detok = None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, state.prompt_token_ids or [], state.params)
            sample = state.samples[index] = _Sample(index, detok)
        if sample.finish_reason is not None:  # stopped here: later tokens are dropped
            return _RUNNING
        detok, last = sample.detokenizer, len(ids) - 1
        if detok is None:  # no tokenizer: no text, no stop strings
            sample.token_ids += ids
            if logprobs is not None:
                sample.logprobs += logprobs
            ids = ()
        for i, token in enumerate(ids):
            sample.token_ids.append(token)
            if logprobs is not None:
                sample.logprobs.append(logprobs[i])
            ends = finish is not None and i == last  # the core finished it with this token
            stop = detok.add_token(token, stopped_by_token and i == last, ends)
            if stop is not None and not ends:  # (else its reason stands, as in-process)
                if cumulative is not None:  # without the dropped tokens' logprobs
                    cumulative -= sum(e[t] for t, e in zip(ids[i + 1:], logprobs[i + 1:],
                                                           strict=True))
                sample.cumulative_logprob = cumulative
                sample.finish_reason, sample.stop_reason = "stop", stop
                return _STOPPED_HERE
        sample.cumulative_logprob = cumulative
        if finish is None:
            return _RUNNING
        sample.finish_reason, sample.stop_reason = finish, stop_reason
        if detok is not None and not ids:
            detok.flush()  # finished without a token (an abort): release held text
        return _FINISHED

    def _output(self, state: RequestState, finished: bool) -> RequestOutput:
        """The request's output now: whole, or (DELTA) what is new since the previous."""
        params = state.params
        want_logprobs = params.logprobs is not None
        delta = params.output_kind is RequestOutputKind.DELTA
        outputs = []
        samples = state.samples
        for s in samples.values() if len(samples) == 1 else [samples[i] for i in sorted(samples)]:
            detok = s.detokenizer
            if delta:
                start, s.num_sent = s.num_sent, len(s.token_ids)
                token_ids = s.token_ids[start:]
                logprobs = s.logprobs[start:] if want_logprobs else None
                text = detok.take_new_text() if detok is not None else ""
            else:
                token_ids = list(s.token_ids)
                logprobs = list(s.logprobs) if want_logprobs else None
                text = detok.output_text if detok is not None else ""
            outputs.append(CompletionOutput(s.index, text, token_ids, s.cumulative_logprob,
                                            logprobs, s.finish_reason, s.stop_reason))
        metrics = state.metrics
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids or [],
                             outputs, finished, metrics, metrics.num_cached_tokens)
