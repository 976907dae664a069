"""Incremental detokenization with stop strings, for streamed outputs (plain Python).

Decoding follows TGI and vLLM: only a short window of ids is decoded each step.

    ids:   [ ...prompt tail... | ...output tokens...                               ]
                 ^ prefix_offset           ^ read_offset                          ^ end
                 |-- prefix_text: decoded -|-- new: decode(ids[prefix:]) minus ---|
                     and already emitted       prefix_text, emitted when whole

The prefix gives the decoder its context (leading spaces, bytes of one character split over
tokens). When the decoded window ends in U+FFFD (half a UTF-8 character) nothing is emitted and
the offsets stay, so the next token can complete the character. After an emission the prefix
moves to the old read offset: each step decodes a few tokens, whatever the output's length.

Stop strings are searched in the text not yet shown. The longest tail of it that could still
grow into a stop string is held back (at most ``max(len(stop)) - 1`` characters), so a stream
never shows a stop string or part of one; ``flush()`` releases it when the request finishes
for another reason (length, EOS, abort).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxllm.sampling_params import RequestOutputKind, SamplingParams

INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5  # prompt tokens of decoder context (vLLM's)
# Give up waiting for a UTF-8 character to complete after this many undecodable tokens: only
# byte sequences that are not UTF-8 get there, and waiting longer would make steps O(n).
MAX_PENDING_TOKENS = 16
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, stopping at stop strings.

    ``output_text`` is the text emitted so far (the concatenation of the deltas); after a stop
    string or ``flush()`` it is the request's whole output text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self.tokenizer = tokenizer  # a transformers tokenizer: decode(ids, skip_special_tokens)
        # A fast tokenizer that does no clean-up decodes as its Rust backend does; calling the
        # backend skips transformers' per-call argument handling (3.4 -> 1.2 us a call on
        # SmolLM2's tokenizer, two calls a token). Any other goes through decode().
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if getattr(tokenizer, "clean_up_tokenization_spaces",
                                           True) is False else None
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings = params.stop
        self.num_output_tokens = 0
        self.stop_str: str | None = None  # set once a stop string ended the output
        tail = list(prompt_token_ids[-(INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2):])
        self._ids: list[int] = tail  # the decode window (older ids are dropped)
        self.prefix_offset = max(len(tail) - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self.read_offset = len(tail)
        self._prefix_text = self._decode(tail[self.prefix_offset:])
        self._held = ""  # decoded text not shown yet: it may be the start of a stop string
        self._chunks: list[str] = []  # emitted deltas
        # Delta outputs only: what was emitted since the last take_new_text().
        self._untaken: list[str] | None = [] if params.output_kind is RequestOutputKind.DELTA \
            else None

    # ------------------------------------------------------------------------------ public

    @property
    def finished(self) -> bool:
        """True once a stop string was found: later tokens are ignored."""
        return self.stop_str is not None

    @property
    def output_text(self) -> str:
        """The text emitted so far; a stop string is cut off unless include_stop_str_in_output."""
        if len(self._chunks) > 1:  # join lazily: appending stays O(delta) per step
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def take_new_text(self) -> str:
        """The text emitted since the previous call (delta outputs): O(new text), where
        ``output_text`` joins the whole output."""
        new, self._untaken = self._untaken, []
        if new is None:
            raise ValueError("take_new_text() is for delta outputs (output_kind=DELTA)")
        return new[0] if len(new) == 1 else "".join(new)

    def update(self, new_token_ids: Sequence[int],
               stop_terminated: bool = False) -> tuple[str, str | None]:
        """Appends sampled ids; returns (text to show now, the stop string if one was found).

        ``stop_terminated``: the last id is EOS or a stop token id that ended the request; as
        in vLLM its text is left out unless ``include_stop_str_in_output``. Call ``flush()``
        after the last update of a request that did not stop on a stop string.
        """
        if self.finished:
            return "", None
        new_ids = list(new_token_ids)
        self.num_output_tokens += len(new_ids)
        if stop_terminated and new_ids and not self.params.include_stop_str_in_output:
            new_ids.pop()
        text = self._decode_new(new_ids, final=False) if new_ids else ""
        return self._release(text, final=False)

    def add_token(self, token: int, stop_terminated: bool, last: bool) -> str | None:
        """One sampled id, as the output paths feed them (one at a time, so that a stop
        string is found at the token that completes it); ``last``: the sequence has finished
        with it, so text held back is released unless a stop string ended the output.
        Returns the stop string found, if any."""
        _, stop = self.update((token,), stop_terminated=stop_terminated)
        if stop is None and last:
            self.flush()
        return stop

    def flush(self) -> str:
        """Releases everything held back: an unfinished UTF-8 character and text that could
        have been the start of a stop string. A stop string found here still ends the text
        (``stop_str`` is then set)."""
        if self.finished:
            return ""
        text = self._decode_new([], final=True) if self.read_offset < len(self._ids) else ""
        return self._release(text, final=True)[0]

    # ----------------------------------------------------------------------------- private

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, new_ids: list[int], final: bool) -> str:
        """Text of the not yet emitted ids, or "" while it ends in half a character."""
        ids = self._ids
        ids.extend(new_ids)
        text = self._decode(ids[self.prefix_offset:])
        pending = len(ids) - self.read_offset
        if not final and text.endswith(REPLACEMENT_CHAR) and pending < MAX_PENDING_TOKENS:
            return ""  # wait for the rest of the character
        new_text = text[len(self._prefix_text):]
        if not new_text and not final:
            # Only skipped (special) tokens: they add no text, so drop them from the window
            # rather than let it grow; the prefix keeps its context.
            del ids[self.read_offset:]
            return ""
        if self.prefix_offset:  # keep the window short: drop what is left of the prefix
            del ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self._prefix_text = self._decode(ids[self.prefix_offset:])
        return new_text

    def _release(self, text: str, final: bool) -> tuple[str, str | None]:
        """Stop-string check and hold-back over the unshown text; emits the safe part."""
        if not self.stop_strings:
            return self._emit(text), None
        unshown = self._held + text
        self._held = ""
        # As vLLM V1: stop strings count once more than min_tokens tokens were generated.
        if self.num_output_tokens > self.params.min_tokens:
            found = _first_stop(unshown, self.stop_strings)
            if found is not None:
                index, stop = found
                self.stop_str = stop
                end = index + len(stop) if self.params.include_stop_str_in_output else index
                return self._emit(unshown[:end]), stop
        keep = 0 if final else _partial_stop_length(unshown, self.stop_strings)
        self._held = unshown[len(unshown) - keep:] if keep else ""
        return self._emit(unshown[:len(unshown) - keep]), None

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
            if self._untaken is not None:
                self._untaken.append(text)
        return text


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in text; ties go to list order."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def _partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
