"""Sampled tokens into sequences, then into text (plain Python, no jax).

``fill_token`` puts each recorded token in its placeholder and applies what the next schedule
depends on (EOS, stop token ids, lengths, a complete grammar); ``detokenize`` later turns the
filled tokens into text and applies stop strings, off the path between a step and the next
launch (:meth:`jaxllm.engine.llm_engine.LLMEngine.step`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from typing import TYPE_CHECKING, Any

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from jaxllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # host arrays only: this module never imports jax
    from jaxllm.engine.scheduler_output import ScheduledSample
    from jaxllm.engine.step_handles import StepResult


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...],
                 finish_seq: Callable[[Sequence, SequenceStatus], None]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._finish_seq = finish_seq  # the scheduler's: frees the sequence's blocks
        # Filled tokens waiting for their text: (seq, group, token, stopped by that token).
        self._pending: list[tuple[Sequence, SequenceGroup, int, bool]] = []

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def attach_detokenizer(self, seq: Sequence, params: SamplingParams) -> None:
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                     params)

    def fill_token(self, seq: Sequence, group: SequenceGroup, result: StepResult,
                   row: int, pos: int, grammar_done: bool = False) -> None:
        """Puts a sampled token in its placeholder and applies the checks the next schedule
        depends on (EOS, stop token ids, lengths); text and stop strings wait for
        ``detokenize``."""
        seq.pending.pop(pos, None)
        if seq.status.is_finished:  # stopped (stop string, abort) after this step launched
            del seq.token_ids[pos:]
            seq.pending.clear()
            return
        token = int(result.sampled[row])
        params = group.params
        seq.token_ids[pos] = token
        logprob = float(result.logprob[row])
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            top = {int(t): float(p) for t, p in zip(result.top_ids[row, :params.logprobs],
                                                    result.top_logprobs[row, :params.logprobs],
                                                    strict=True)}
            seq.logprobs.append({token: logprob} | top)
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = time.monotonic()
        num_output = pos + 1 - seq.num_prompt_tokens
        enough = num_output >= params.min_tokens
        status, stop_reason = None, None
        if enough and not params.ignore_eos and token in self.eos_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
        elif enough and token in params.stop_token_ids:
            status, stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif num_output >= seq.output_limit:
            status = SequenceStatus.FINISHED_LENGTH
        # A stop token's text is not output (unless asked for); a grammar's last token is.
        stopped_by_token = status == SequenceStatus.FINISHED_STOPPED
        seq.stopped_by_token = stopped_by_token  # for a front end's detokenizer
        if grammar_done and status is None:
            status = SequenceStatus.FINISHED_STOPPED  # the grammar is complete
        if status is not None:
            del seq.token_ids[pos + 1:]  # a placeholder of the step in flight, if any
            seq.pending.clear()
            seq.stop_reason = stop_reason
            self._finish_seq(seq, status)
        self._pending.append((seq, group, token, stopped_by_token))

    def fill_tokens(self, samples: Sequence_[ScheduledSample], result: StepResult,
                    positions: Sequence_[int]) -> None:
        """``fill_token`` for every sample row of a step (row r = ``samples[r]``), with the
        commonest case inline: a running sequence whose token ends nothing, without
        logprobs asked, past its first token. It runs for every row every step."""
        count = len(samples)
        tokens = result.sampled[:count].tolist()  # one conversion, not a numpy scalar a row
        logprobs = result.logprob[:count].tolist()
        eos, pending, running = self.eos_token_ids, self._pending, SequenceStatus.RUNNING
        for r, row in enumerate(samples):
            seq, group, token, pos = row.seq, row.group, tokens[r], positions[r]
            params = group.params
            if (seq.status is not running or params.logprobs is not None
                    or group.metrics.first_token_time is None
                    or pos + 1 - len(seq.prompt_token_ids) >= seq.output_limit
                    or token in params.stop_token_ids
                    or (token in eos and not params.ignore_eos)):
                self.fill_token(seq, group, result, r, pos)
                continue
            seq.pending.pop(pos, None)
            seq.token_ids[pos] = token
            seq.cumulative_logprob += logprobs[r]
            seq.stopped_by_token = False
            pending.append((seq, group, token, False))

    def finish_grammar(self, seq: Sequence, pos: int) -> None:
        """Stops a sequence whose grammar its token at ``pos`` completed, learned after
        ``fill_token`` (the grammars take a step's tokens on their own thread): as
        ``fill_token`` would have, unless something else stopped it first."""
        if seq.status.is_finished:
            return
        del seq.token_ids[pos + 1:]  # placeholders of steps in flight
        seq.pending.clear()
        seq.stop_reason = None
        self._finish_seq(seq, SequenceStatus.FINISHED_STOPPED)

    def detokenize(self) -> list[SequenceGroup]:
        """Text for the filled tokens, stop strings applied (a match finishes its sequence);
        returns the groups that progressed, in order."""
        pending, self._pending = self._pending, []
        touched: dict[str, SequenceGroup] = {}
        for seq, group, token, stopped_by_token in pending:
            touched[group.request_id] = group
            if seq.detokenizer is None:
                if self.tokenizer is None:
                    continue
                self.attach_detokenizer(seq, group.params)  # a child forked this step
            # A finished sequence's held-back text is released (flush), unless a stop
            # string ended it.
            finished = seq.status.is_finished
            stop_str = seq.detokenizer.add_token(token, stopped_by_token, finished)
            if stop_str is not None and not finished:
                seq.stop_reason = stop_str
                self._finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
        return list(touched.values())
