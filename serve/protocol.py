"""Request bodies of /v1/completions and /v1/chat/completions, checked field by field.

Every check raises :class:`~serve.errors.APIError` (400) naming the field, so bad input never
reaches the engine; sampling ranges and their messages come from
:class:`~jaxllm.sampling_params.SamplingParams` (vLLM's). Unknown fields are ignored, as
vLLM does; known OpenAI/vLLM features jaxllm lacks are refused with 400 rather than ignored.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxllm.serve.constraints import structured_outputs
from jaxllm.serve.errors import bad_request
from jaxllm.serve.tools import ToolRequest, parse_tools

from jaxllm.sampling_params import (
    MAX_LOGPROBS,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

MAX_PROMPTS = 128  # prompts in one completions request
MAX_STOP = 64  # stop strings / stop token ids per request
MAX_STOP_CHARS = 256
INT64 = 2**63
MAX_TOP_K = 2**31 - 1  # the sampler's int32 column; any k past the vocabulary means "off"
# Fields that change the output but have no implementation here: refuse rather than ignore.
UNSUPPORTED = ("suffix", "logit_bias", "allowed_token_ids", "bad_words", "logits_processors",
               "prompt_logprobs", "prompt_embeds", "chat_template", "functions",
               "structural_tag", "guided_whitespace_pattern")


@dataclasses.dataclass
class GenerationRequest:
    """A validated completions or chat request (prompts are rendered/tokenized later)."""

    chat: bool
    model: str | None
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    priority: int = 0
    echo: bool = False
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False
    prompts: list[str | list[int]] = dataclasses.field(default_factory=list)  # completions
    messages: list[dict] = dataclasses.field(default_factory=list)  # chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    top_logprobs: int | None = None  # chat: alternatives per token when logprobs=true
    constraint_field: str | None = None  # where params.structured_outputs came from
    tools: ToolRequest | None = None  # chat: tools, tool_choice, parallel_tool_calls


class Fields:
    """Typed access to a JSON object; ``null`` counts as absent (clients send both)."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise bad_request(f"the request body must be a JSON object, got "
                              f"{_json_type(body)}")
        self.body = body

    def present(self, name: str) -> bool:
        return self.body.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        value = self.body.get(name)
        return default if value is None else value

    def bool(self, name: str, default: bool) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise bad_request(f"{name} must be a boolean, got {_json_type(value)}", name)
        return value

    def int(self, name: str, default: int | None, lo: int | None = None,
            hi: int | None = None) -> int | None:
        value = self.raw(name, default)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad_request(f"{name} must be an integer, got {_json_type(value)}", name)
        if lo is not None and value < lo or hi is not None and value > hi:
            raise bad_request(f"{name} must be in [{lo}, {hi}], got {value}", name)
        return value

    def number(self, name: str, default: float) -> float:
        value = self.raw(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad_request(f"{name} must be a number, got {_json_type(value)}", name)
        if not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value}", name)
        return float(value)

    def str(self, name: str, default: str | None = None) -> str | None:
        value = self.raw(name, default)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{name} must be a string, got {_json_type(value)}", name)
        return value

    def object(self, name: str) -> dict:
        value = self.raw(name, {})
        if not isinstance(value, dict):
            raise bad_request(f"{name} must be an object, got {_json_type(value)}", name)
        return value

    def stop(self) -> tuple[str, ...]:
        value = self.raw("stop", [])
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise bad_request("stop must be a string or a list of strings", "stop")
        if len(value) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in value):
            raise bad_request(f"stop takes at most {MAX_STOP} strings of at most "
                              f"{MAX_STOP_CHARS} characters", "stop")
        return tuple(value)

    def token_ids(self, name: str, vocab_size: int) -> tuple[int, ...]:
        value = self.raw(name, [])
        if not isinstance(value, list) or len(value) > MAX_STOP:
            raise bad_request(f"{name} must be a list of at most {MAX_STOP} token ids", name)
        return tuple(check_token_ids(value, vocab_size, name))


def check_token_ids(ids: Any, vocab_size: int, param: str) -> list[int]:
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request(f"{param} must be a list of integer token ids", param)
    if any(t < 0 for t in ids):
        raise bad_request(f"{param}: token ids must be greater than or equal to 0", param)
    if ids and max(ids) >= vocab_size:
        raise bad_request(f"Token id {max(ids)} is out of vocabulary", param)
    return ids


def parse_completion(body: Any, *, vocab_size: int, max_n: int) -> GenerationRequest:
    f = Fields(body)
    _refuse_unsupported(f)
    if f.bool("use_beam_search", False):
        raise bad_request("beam search is not supported", "use_beam_search")
    prompts = _prompts(f.raw("prompt"), vocab_size)
    logprobs = f.int("logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
    echo = f.bool("echo", False)
    if echo and logprobs is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, which are not supported",
                          "echo")
    constraint_field, constraint = structured_outputs(f) or (None, None)
    req = GenerationRequest(chat=False, model=f.str("model"), prompts=prompts, echo=echo,
                            params=_sampling(f, vocab_size, max_n, max_tokens=f.int(
                                "max_tokens", 16), logprobs=logprobs,
                                structured=constraint),
                            add_special_tokens=f.bool("add_special_tokens", True),
                            constraint_field=constraint_field)
    return _common(f, req)


def parse_chat(body: Any, *, vocab_size: int, max_n: int,
               auto_tools: bool = False) -> GenerationRequest:
    """``auto_tools``: the server parses tool calls from free text (--enable-auto-tool-choice
    with a --tool-call-parser), so tool_choice "auto" is allowed."""
    f = Fields(body)
    _refuse_unsupported(f)
    tools = parse_tools(f.body, auto_enabled=auto_tools)
    messages = parse_messages(f.raw("messages"))
    top = f.int("top_logprobs", None)
    want_logprobs = f.bool("logprobs", False)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                          "top_logprobs")
    if top and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens = f.int("max_completion_tokens", None)
    legacy_max_tokens = f.int("max_tokens", None)  # checked even when the newer name wins
    if max_tokens is None:
        max_tokens = legacy_max_tokens
    elif legacy_max_tokens is not None and legacy_max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {legacy_max_tokens}",
                          "max_tokens")
    kwargs = f.object("chat_template_kwargs")
    if any(not isinstance(k, str) or k in RESERVED_TEMPLATE_KWARGS for k in kwargs) or any(
            not isinstance(v, (str, int, float, bool)) for v in kwargs.values()):
        raise bad_request("chat_template_kwargs takes template variables with string, number "
                          f"or boolean values (not {sorted(RESERVED_TEMPLATE_KWARGS)})",
                          "chat_template_kwargs")
    constraint_field, constraint = structured_outputs(f) or (None, None)
    if tools is not None and tools.constraint is not None:
        if constraint is not None:
            raise bad_request(f'tool_choice "{tools.choice}" constrains the output itself: it '
                              f"cannot be combined with {constraint_field}", constraint_field)
        constraint_field, constraint = "tool_choice", tools.constraint
    req = GenerationRequest(
        chat=True, tools=tools, model=f.str("model"), messages=messages,
        constraint_field=constraint_field,
        params=_sampling(f, vocab_size, max_n, max_tokens=max_tokens,
                         logprobs=(top or 0) if want_logprobs else None,
                         structured=constraint),
        top_logprobs=(top or 0) if want_logprobs else None,
        add_special_tokens=f.bool("add_special_tokens", False),
        add_generation_prompt=f.bool("add_generation_prompt", True),
        continue_final_message=f.bool("continue_final_message", False),
        chat_template_kwargs=kwargs)
    if req.add_generation_prompt and req.continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be "
                          "true", "continue_final_message")
    return _common(f, req)


# apply_chat_template's own parameters: a request must not reach them through kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _common(f: Fields, req: GenerationRequest) -> GenerationRequest:
    req.stream = f.bool("stream", False)
    options = f.object("stream_options")
    if f.present("stream_options") and not req.stream:
        raise bad_request("Stream options can only be defined when `stream=True`.",
                          "stream_options")
    req.include_usage = _flag(options, "include_usage")
    req.continuous_usage_stats = _flag(options, "continuous_usage_stats")
    req.priority = f.int("priority", 0, -INT64, INT64 - 1)
    req.truncate_prompt_tokens = f.int("truncate_prompt_tokens", None, 1, None)
    req.return_tokens_as_token_ids = f.bool("return_tokens_as_token_ids", False)
    return req


def _flag(options: dict, name: str) -> bool:
    value = options.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"stream_options.{name} must be a boolean", "stream_options")
    return value


def _sampling(f: Fields, vocab_size: int, max_n: int, *, max_tokens: int | None,
              logprobs: int | None,
              structured: StructuredOutputsParams | None = None) -> SamplingParams:
    f.str("user")  # a string, as OpenAI's; accepted and unused
    n = f.int("n", 1)
    if n is not None and n > max_n:
        raise bad_request(f"n={n} exceeds the server's limit of {max_n} (max_num_seqs)", "n")
    best_of = f.int("best_of", None)
    if best_of is not None and best_of != n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    top_k = f.int("top_k", 0, -1, MAX_TOP_K)
    seed = f.int("seed", None, -INT64, INT64 - 1)
    fields = dict(
        n=n, temperature=f.number("temperature", 1.0), top_p=f.number("top_p", 1.0),
        top_k=top_k, min_p=f.number("min_p", 0.0),
        repetition_penalty=f.number("repetition_penalty", 1.0),
        presence_penalty=f.number("presence_penalty", 0.0),
        frequency_penalty=f.number("frequency_penalty", 0.0), seed=seed, stop=f.stop(),
        stop_token_ids=f.token_ids("stop_token_ids", vocab_size),
        include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
        ignore_eos=f.bool("ignore_eos", False), max_tokens=max_tokens,
        min_tokens=f.int("min_tokens", 0), logprobs=logprobs,
        skip_special_tokens=f.bool("skip_special_tokens", True),
        structured_outputs=structured,
        # The server reads only what is new each step (responses.ResponseBuilder), so the
        # engine never copies a request's whole output per step.
        output_kind=RequestOutputKind.DELTA)
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        message = str(e)
        param = next((name for name in sorted(fields, key=len, reverse=True)
                      if message.startswith(name)), None)
        raise bad_request(message, param) from None


def _refuse_unsupported(f: Fields) -> None:
    for name in UNSUPPORTED:
        value = f.body.get(name)
        if value not in (None, "", [], {}):
            raise bad_request(f"{name} is not supported by this server", name)


def _prompts(value: Any, vocab_size: int) -> list[str | list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of those."""
    empty = "Either prompt or prompt_embeds must be provided and non-empty."
    if value is None or value == "" or value == []:
        raise bad_request(empty, "prompt")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise bad_request(f"prompt must be a string, a list of strings or a list of token ids, "
                          f"got {_json_type(value)}", "prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
        return [check_token_ids(value, vocab_size, "prompt")]
    if len(value) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}",
                          "prompt")
    if not (all(isinstance(p, str) for p in value) or all(isinstance(p, list) for p in value)):
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or "
                          "a list of token-id lists (not a mix)", "prompt")
    prompts: list[str | list[int]] = []
    for p in value:
        if isinstance(p, str):
            prompts.append(p)
        elif isinstance(p, list):
            prompts.append(check_token_ids(p, vocab_size, "prompt"))
        else:
            raise bad_request("prompt must be a string, a list of strings or a list of token "
                              "ids", "prompt")
        if not p:
            raise bad_request(empty, "prompt")
    return prompts


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(value: Any) -> list[dict]:
    """Chat messages reduced to what templates see: role, text content and name."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                              f"got {role!r}"[:200], "messages")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad_request(f"messages[{i}].content: only text parts are supported",
                                      "messages")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text "
                              f"parts, got {_json_type(content)}", "messages")
        clean = {"role": role, "content": content}
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise bad_request(f"messages[{i}].name must be a string", "messages")
            clean["name"] = message["name"]
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = _tool_calls(i, message["tool_calls"])
            if calls:
                clean["tool_calls"] = calls
        if role == "tool" and message.get("tool_call_id") is not None:
            if not isinstance(message["tool_call_id"], str):
                raise bad_request(f"messages[{i}].tool_call_id must be a string", "messages")
            clean["tool_call_id"] = message["tool_call_id"]
        messages.append(clean)
    return messages


def _tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's earlier tool calls, as OpenAI sends them back."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list", "messages")
    clean = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", ""), str)
                and isinstance(call.get("id", ""), str)
                and call.get("type", "function") == "function"):
            raise bad_request(f"{where}: each call needs function.name and function.arguments "
                              '(a JSON string), and takes a string id and type "function"',
                              "messages")
        clean.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function["name"],
                                   "arguments": function.get("arguments", "")}})
    return clean


def _json_type(value: Any) -> str:
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                       (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__
