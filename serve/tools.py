"""Tool calling on /v1/chat/completions: the ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` fields, and what each choice asks of the engine.

- ``"none"``: plain text (the tools are still rendered into the prompt, as vLLM does);
- ``"auto"``: free text, parsed afterwards by the server's ``--tool-call-parser`` (needs
  ``--enable-auto-tool-choice``, as in vLLM);
- ``"required"``: output constrained to a JSON list of ``{"name", "parameters"}`` calls;
- a named function: output constrained to that function's arguments object.
The last two go through the grammar engine, so their output always parses.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxllm.serve.errors import bad_request
from jaxllm.serve.tool_parsers import ToolCall, get_tool_parser, new_tool_call_id

from jaxllm.sampling_params import StructuredOutputsParams

MAX_TOOLS = 128


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]  # OpenAI's {"type": "function", "function": {...}}, checked
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function, for a named choice
    parallel: bool = True

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that makes ``required`` and named choices parse (compact JSON: the
        calls are read by programs, and free whitespace only spends tokens)."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self.function(self.named).get(
                "parameters", {"type": "object"}), disable_any_whitespace=True)
        if self.choice == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel),
                                           disable_any_whitespace=True)
        return None

    def function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def parse_tools(body: dict, *, auto_enabled: bool) -> ToolRequest | None:
    """The request's tool fields, checked (400 naming the field when bad); None without
    tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    checked = tuple(_check_tool(i, t) for i, t in enumerate(_tool_list(tools)))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise bad_request("tools: every function needs a distinct name", "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" \
            else None
        if not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                              '"function", "function": {"name": ...}}', "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in "
                              f"tools"[:300], "tool_choice")
        return ToolRequest(checked, "named", name, parallel)
    if choice not in ("none", "auto", "required"):
        raise bad_request('tool_choice must be "none", "auto", "required" or a named '
                          'function', "tool_choice")
    if choice == "auto" and not auto_enabled:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                          '--tool-call-parser to be set', "tool_choice")
    return ToolRequest(checked, choice, None, parallel)


def _tool_list(tools: Any) -> list:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools per request, got {len(tools)}", "tools")
    return tools


def _check_tool(index: int, tool: Any) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}',
                          "tools")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not function["name"]:
        raise bad_request(f"{where}.function needs a name", "tools")
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                          "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    clean = {"name": function["name"], "parameters": parameters}
    if description is not None:
        clean["description"] = description
    return {"type": "function", "function": clean}


def required_schema(tools: tuple[dict, ...], parallel: bool) -> dict:
    """A JSON list of calls, each naming one of the tools with its own parameters."""
    calls = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t["function"]["name"]]},
        "parameters": t["function"]["parameters"]},
        "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    defs = {}
    for t in tools:  # hoisted so that "$ref": "#/$defs/..." resolves from the new root
        for key, value in t["function"]["parameters"].get("$defs", {}).items():
            if defs.get(key, value) != value:
                raise bad_request(f"tools: $defs.{key} differs between tools", "tools")
            defs[key] = value
    if defs:
        schema["$defs"] = defs
    return schema


def calls_from_constrained_output(request: ToolRequest, text: str) -> list[tuple[str, str]]:
    """(name, arguments JSON) of each call in a ``required`` choice's output, which the
    grammar made valid; an output cut short (max_tokens) gives no calls."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return [(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
            for call in value]


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant's tool-call arguments as objects
    (templates serialise them themselves), not OpenAI's JSON strings."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = dict(message)
            message["tool_calls"] = [_template_call(c) for c in calls]
        out.append(message)
    return out


def _template_call(call: dict) -> dict:
    function = dict(call["function"])
    try:
        function["arguments"] = json.loads(function["arguments"])
    except ValueError:
        pass  # a template that wants text still gets it
    return {**call, "function": function}


class ToolOutput:
    """One choice's output as a chat message with tool calls, whole or streamed.

    ``auto`` parses the text with the server's parser; a named choice's output is the
    arguments (streamed as they are generated); ``required`` gives its calls once the JSON
    list is complete. finish_reason is "tool_calls" when calls were made (a named choice keeps
    "stop", as OpenAI reports a forced function)."""

    def __init__(self, request: ToolRequest, parser_name: str | None):
        self.request = request
        self._parser = get_tool_parser(parser_name) if request.choice == "auto" else None
        self._stream = (self._parser.streaming(request.parallel) if self._parser is not None
                        else None)
        self._id = new_tool_call_id()
        self._sent = 0  # named choice: characters of arguments already streamed
        self.made_calls = False

    def message(self, text: str) -> dict:
        """The whole message: content and tool_calls."""
        if self._parser is not None:
            found = self._parser.extract(text, self.request.parallel)
            calls = [c.to_openai() for c in found.tool_calls]
            content = found.content
        else:
            calls = [ToolCall(name, args, new_tool_call_id()).to_openai()
                     for name, args in self._constrained_calls(text)]
            content = None if calls else text
        self.made_calls = bool(calls)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message

    def deltas(self, text: str, finished: bool) -> list[dict]:
        """Chunk deltas for the cumulative ``text``."""
        if self._stream is not None:
            out = self._stream.feed(text, finished)
            self.made_calls = self._stream.found_tool_calls
            return out
        if self.request.choice == "named":
            out = []
            if self._sent == 0 and text:
                out.append({"tool_calls": [{"index": 0, "id": self._id, "type": "function",
                                            "function": {"name": self.request.named,
                                                         "arguments": ""}}]})
                self.made_calls = True
            if len(text) > self._sent:
                out.append({"tool_calls": [{"index": 0, "function": {
                    "arguments": text[self._sent:]}}]})
                self._sent = len(text)
            return out
        if not finished:
            return []
        calls = self._constrained_calls(text)
        self.made_calls = bool(calls)
        if not calls:
            return [{"content": text}] if text else []
        return [{"tool_calls": [{"index": k, **ToolCall(name, args, new_tool_call_id())
                                 .to_openai()} for k, (name, args) in enumerate(calls)]}]

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.made_calls and self.request.choice != "named":
            return "tool_calls"
        return reason

    def _constrained_calls(self, text: str) -> list[tuple[str, str]]:
        if self.request.choice == "named":
            # The output is the arguments, as generated (streamed the same way).
            return [(self.request.named, text)] if _parses(text) else []
        return calls_from_constrained_output(self.request, text)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
