"""Tool-call parsers: turn a model's text into OpenAI ``tool_calls``, whole or while streaming.

Two formats, as vLLM's parsers of the same names read them:

* ``hermes`` (Qwen, Hermes): ``text<tool_call>{"name": ..., "arguments": {...}}</tool_call>...``
* ``llama3_json`` (Llama 3.x): ``<|python_tag|>{"name": ..., "parameters": {...}}; {...}``

A parser never raises on model output: anything malformed comes back as plain content.

Each parser has one scanning routine, ``_step``, that both ``extract`` (the whole output) and
``StreamingToolCallParser`` (a growing output) use, so the two can only disagree where a stream
has already sent a call and a later block turns out malformed (a sent call cannot be recalled).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

_WHITESPACE = re.compile(r"\s*")


def new_tool_call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]


@dataclasses.dataclass
class _Progress:
    """What ``_step`` learned from the output so far."""

    calls: list[ToolCall]  # calls completed since the cursor it was given
    cursor: int  # where the next step resumes
    content_end: int  # text[:content_end] is content whatever the rest turns out to be
    plain: bool = False  # the output is not (valid) tool calls: all of it is content


def _skip_whitespace(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def _held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that could grow into ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _tool_call(obj: object, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A ToolCall from a decoded ``{"name": ..., <argument key>: {...}}``, or None if malformed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    if key is None:
        return None
    arguments = obj[key]
    if isinstance(arguments, str):  # some models encode the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False), new_tool_call_id())


class ToolParser:
    name: str

    def extract(self, text: str, parallel: bool = True) -> ExtractedToolCalls:
        """Content and tool calls of a whole model output. ``parallel=False`` keeps only the
        first call, as vLLM does when a request sets ``parallel_tool_calls: false``."""
        progress = self._step(text, 0, finished=True)
        if progress.plain:
            return ExtractedToolCalls(text, [])
        calls = progress.calls if parallel else progress.calls[:1]
        return ExtractedToolCalls(text[:progress.content_end] or None, calls)

    def streaming(self, parallel: bool = True) -> StreamingToolCallParser:
        return StreamingToolCallParser(self, parallel)

    def _step(self, text: str, cursor: int, finished: bool) -> _Progress:
        """Scans ``text`` from ``cursor`` (0, or a cursor an earlier step of the same, shorter
        output returned). With ``finished`` the text is final and nothing stays pending."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    start_tag = "<tool_call>"
    # A final block may lack its end tag (the output hit a stop condition inside it).
    _block = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def _step(self, text: str, cursor: int, finished: bool) -> _Progress:
        start = text.find(self.start_tag)
        if start < 0:
            if finished:
                return _Progress([], 0, len(text), plain=True)
            # Trailing whitespace is held too: it is stripped if a tool call follows.
            safe = text[:len(text) - _held_tag_prefix(text, self.start_tag)].rstrip()
            return _Progress([], 0, len(safe))
        # Content before the first call loses trailing whitespace only: leading whitespace
        # was already streamed before anyone could know a call would follow.
        content_end = len(text[:start].rstrip())
        calls = []
        # Text between and after blocks is ignored, as vLLM does.
        for match in self._block.finditer(text, max(cursor, start)):
            body = match.group(1)
            if body is None:  # unterminated: complete only once the output is
                if not finished:
                    break
                body = match.group(2)
            try:
                call = _tool_call(json.loads(body), ("arguments",))
            except (ValueError, RecursionError):
                call = None
            if call is None:
                return _Progress(calls, cursor, content_end, plain=True)
            calls.append(call)
            cursor = match.end()
        return _Progress(calls, cursor, content_end)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"
    _decoder = json.JSONDecoder()

    def _first_object(self, text: str) -> int | None:
        """Index of the first call's ``{``; -1 while the output may still become a call."""
        pos = _skip_whitespace(text, 0)
        if text.startswith(self.python_tag, pos):
            pos = _skip_whitespace(text, pos + len(self.python_tag))
        elif self.python_tag.startswith(text[pos:]):
            return -1  # nothing yet, or a prefix of the python tag
        if pos == len(text):
            return -1
        return pos if text[pos] == "{" else None

    def _step(self, text: str, cursor: int, finished: bool) -> _Progress:
        if cursor == 0:  # no call committed yet: is this a tool call at all?
            first = self._first_object(text)
            if first is None or (first < 0 and finished):
                return _Progress([], 0, 0, plain=True)
            if first < 0:
                return _Progress([], 0, 0)
            cursor = first
        calls = []
        # A call is committed (and the cursor moved past it) once what follows it shows it is
        # whole: a ";" separator, or the end of a finished output.
        while (pos := _skip_whitespace(text, cursor)) < len(text):
            try:
                obj, end = self._decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):
                if finished:
                    return _Progress(calls, cursor, 0, plain=True)
                break  # most likely incomplete: wait for more text
            call = _tool_call(obj, ("arguments", "parameters"))
            if call is None:
                return _Progress(calls, cursor, 0, plain=True)
            after = _skip_whitespace(text, end)
            if after == len(text):
                if finished:
                    calls.append(call)
                    cursor = after
                break
            if text[after] != ";":
                return _Progress(calls, cursor, 0, plain=True)
            calls.append(call)
            cursor = after + 1
        return _Progress(calls, cursor, 0)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        valid = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; valid parsers: {valid}") from None


class StreamingToolCallParser:
    """Turns a growing output into chat-completion-chunk ``delta`` dicts.

    ``feed`` takes the cumulative text after each engine step. Content goes out as soon as it
    cannot be part of a tool call; each call goes out whole (id, name, all arguments) in one
    delta once its block is complete. At the end the streamed content and calls equal
    ``extract``'s, unless a malformed block follows calls already sent: those stay sent and
    the rest of the output is dropped.
    """

    def __init__(self, parser: ToolParser, parallel: bool = True):
        self.parser = parser
        self.parallel = parallel
        self._cursor = 0
        self._content_sent = 0  # the content sent so far is text[:_content_sent]
        self._calls_seen = 0  # calls parsed, including those parallel=False holds back
        self._calls_sent = 0
        self._plain = False  # decided: the whole output is content
        self._stopped = False  # malformed after calls were sent, or finished

    @property
    def found_tool_calls(self) -> bool:
        return self._calls_sent > 0

    def feed(self, text: str, finished: bool) -> list[dict]:
        if self._stopped:
            return []
        deltas = []
        if not self._plain:
            progress = self.parser._step(text, self._cursor, finished)
            if progress.plain and self._calls_sent == 0:
                self._plain = True
            elif progress.plain:
                self._stopped = True
                return []
            else:
                self._cursor = progress.cursor
                deltas += self._content(text, progress.content_end)
                for call in progress.calls:
                    if self.parallel or self._calls_seen == 0:
                        delta = {"index": self._calls_sent, **call.to_openai()}
                        deltas.append({"tool_calls": [delta]})
                        self._calls_sent += 1
                    self._calls_seen += 1
        if self._plain:
            deltas += self._content(text, len(text))
        self._stopped = finished
        return deltas

    def _content(self, text: str, end: int) -> list[dict]:
        if end <= self._content_sent:
            return []
        delta = {"content": text[self._content_sent:end]}
        self._content_sent = end
        return [delta]
