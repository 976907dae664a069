"""Response bodies and SSE chunks of completions and chat completions, as vLLM/OpenAI send
them. A :class:`ResponseBuilder` turns the engine's delta outputs
(``RequestOutputKind.DELTA``: each holds only what is new) into stream chunks (one per choice,
empty ones skipped), or gathers them into a whole response."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

from jaxllm.serve.protocol import GenerationRequest
from jaxllm.serve.tools import ToolOutput

from jaxllm.engine.outputs import CompletionOutput, RequestOutput

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + \
        b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclasses.dataclass
class _Choice:
    text_offset: int = 0  # completions logprobs: offset of the next token's text
    num_tokens: int = 0
    finished: bool = False
    started: bool = False  # echo / role sent
    text: str = ""  # the output so far, kept where it is read whole (tool calls)
    # Non-streaming: the output gathered from the deltas (``add``).
    parts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    last: CompletionOutput | None = None  # the newest delta (finish and stop reasons)


class ResponseBuilder:
    """Bodies for one request of ``len(prompt_lens)`` prompts with ``n`` samples each.

    ``token_text(id)`` gives a token's text for logprobs; ``prompt_texts`` the prompts for echo;
    ``tool_call_parser`` reads tool calls from text when the request lets the model choose.
    """

    def __init__(self, req: GenerationRequest, request_id: str, model: str,
                 prompt_lens: list[int], prompt_texts: list[str],
                 token_text: Callable[[int], str], tool_call_parser: str | None = None):
        self.req = req
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.n = req.params.n
        self.prompt_lens = prompt_lens
        self.prompt_texts = prompt_texts
        self._token_text = token_text
        self.choices = [_Choice() for _ in range(len(prompt_lens) * self.n)]
        self.object = "chat.completion" if req.chat else "text_completion"
        calls_tools = req.chat and req.tools is not None and req.tools.choice != "none"
        self.tools = [ToolOutput(req.tools, tool_call_parser) if calls_tools else None
                      for _ in self.choices]

    # ----------------------------------------------------------------- non-streaming
    def add(self, prompt_index: int, output: RequestOutput) -> None:
        """Gathers one delta output of prompt ``prompt_index`` for ``full``."""
        for out in output.outputs:
            state = self.choices[prompt_index * self.n + out.index]
            state.parts.append(out.text)
            state.token_ids += out.token_ids
            if out.logprobs is not None:
                if state.logprobs is None:
                    state.logprobs = []
                state.logprobs.extend(out.logprobs)
            state.last = out
            state.num_tokens = len(state.token_ids)

    def full(self) -> dict:
        """The whole response, from what ``add`` gathered."""
        choices = [self._full_choice(index, state) for index, state in enumerate(self.choices)
                   if state.last is not None]
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}

    def _full_choice(self, index: int, state: _Choice) -> dict:
        text = "".join(state.parts)
        logprobs = self._logprobs(state, state.token_ids, state.logprobs)
        choice = {"index": index}
        finish = state.last.finish_reason or "abort"
        tool = self.tools[index]
        if tool is not None:
            choice["message"] = tool.message(text)
            finish = tool.finish_reason(finish)
        elif self.req.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            echo = self.prompt_texts[index // self.n] if self.req.echo else ""
            choice["text"] = echo + text
        choice.update(logprobs=logprobs, finish_reason=finish,
                      stop_reason=state.last.stop_reason)
        return choice

    def usage(self) -> dict:
        return usage(sum(self.prompt_lens), sum(c.num_tokens for c in self.choices))

    # --------------------------------------------------------------------- streaming
    def first_chunks(self) -> list[dict]:
        """Chat: one chunk per choice carrying the assistant role, before any content."""
        if not self.req.chat:
            return []
        chunks = []
        for index, choice in enumerate(self.choices):
            choice.started = True
            chunks.append(self._chunk({"index": index, "delta": {"role": "assistant",
                                                                 "content": ""},
                                       "logprobs": None, "finish_reason": None}, index))
        return chunks

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[dict]:
        """Stream chunks for one delta output (what is new since the previous one)."""
        chunks = []
        for out in output.outputs:
            index = prompt_index * self.n + out.index
            state = self.choices[index]
            if state.finished:
                continue
            text, new_tokens = out.text, out.token_ids
            state.num_tokens += len(new_tokens)
            finish = out.finish_reason or ("abort" if output.finished else None)
            want_logprobs = out.logprobs is not None and bool(new_tokens)
            tool = self.tools[index]
            pieces = [{"content": text}] if text else []
            if tool is not None:
                state.text += text
                pieces = tool.deltas(state.text, finish is not None)
                finish = tool.finish_reason(finish)
            if not pieces and finish is None and not want_logprobs:
                continue  # nothing to show yet (text held back, or an empty prefill step)
            logprobs = None
            if out.logprobs is not None:
                logprobs = self._logprobs(state, new_tokens, out.logprobs)
            if not state.started:
                state.started = True
                if self.req.echo:
                    text = self.prompt_texts[prompt_index] + text
            state.finished = finish is not None
            if not self.req.chat:
                choice = {"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": finish,
                          "stop_reason": out.stop_reason if finish else None}
                chunks.append(self._chunk(choice, index))
                continue
            pieces = pieces or [{"content": ""}]
            for j, delta in enumerate(pieces):  # the last one carries the finish reason
                last = j == len(pieces) - 1
                chunks.append(self._chunk({
                    "index": index, "delta": delta, "logprobs": logprobs if j == 0 else None,
                    "finish_reason": finish if last else None,
                    "stop_reason": out.stop_reason if finish and last else None}, index))
        return chunks

    def usage_chunk(self) -> dict:
        return {"id": self.id, "object": self._chunk_object, "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage()}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.req.chat else "text_completion"

    def _chunk(self, choice: dict, index: int) -> dict:
        chunk = {"id": self.id, "object": self._chunk_object, "created": self.created,
                 "model": self.model, "choices": [choice]}
        if self.req.continuous_usage_stats:
            chunk["usage"] = usage(self.prompt_lens[index // self.n],
                                   self.choices[index].num_tokens)
        return chunk

    # ---------------------------------------------------------------------- logprobs
    def _token(self, token_id: int) -> str:
        if self.req.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return self._token_text(token_id)

    def _logprobs(self, state: _Choice, token_ids: list[int],
                  entries: list[dict[int, float]] | None) -> dict | None:
        """OpenAI's logprobs object for ``token_ids``; each entry maps the sampled id and the
        top-k ids to their logprobs (the sampled id first)."""
        if entries is None:
            return None
        if self.req.chat:
            k = self.req.top_logprobs or 0
            return {"content": [self._chat_entry(t, e, k)
                                for t, e in zip(token_ids, entries, strict=True)]}
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self._token(token_id)
            tokens.append(text)
            token_logprobs.append(entry[token_id])
            top.append({self._token(t): lp for t, lp in entry.items()})
            offsets.append(state.text_offset)
            state.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, entry: dict[int, float], k: int) -> dict:
        # The entry holds the sampled id plus the top k; the sampled one is extra when the
        # entry has k + 1 ids.
        alternatives = list(entry.items())[1:] if len(entry) > k else list(entry.items())
        alternatives.sort(key=lambda item: -item[1])
        text = self._token(token_id)
        return {"token": text, "logprob": entry[token_id], "bytes": list(text.encode()),
                "top_logprobs": [{"token": self._token(t), "logprob": lp,
                                  "bytes": list(self._token(t).encode())}
                                 for t, lp in alternatives[:k]]}
