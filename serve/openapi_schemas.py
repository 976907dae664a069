"""The component schemas of the server's OpenAPI document (``openapi.py`` assembles the
document): the request bodies as protocol.py and tools.py parse them, the responses as
responses.py writes them, and the small builders they share.

A field whose maximum depends on the served model carries a :data:`LIMIT` mark, which
``openapi.limited`` turns into that maximum.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from jaxllm.serve import constraints, protocol
from jaxllm.serve.errors import ERROR_TYPES
from jaxllm.serve.protocol import INT64, MAX_STOP
from jaxllm.serve.tools import MAX_TOOLS

from jaxllm.sampling_params import MAX_LOGPROBS

REFUSED = ("Refused with 400 when given a non-empty value (no implementation here): "
           + ", ".join(protocol.UNSUPPORTED) + ".")


# ------------------------------------------------------------------------- helpers
def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict) -> dict:
    if isinstance(schema.get("type"), str) and "enum" not in schema:
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def obj(properties: dict, required: Sequence[str] = (), **extra) -> dict:
    schema = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    return schema


def request(properties: dict, required: Sequence[str] = (), **extra) -> dict:
    """A request body: optional fields take null; unknown fields are ignored (as vLLM)."""
    return obj({k: v if k in required else nullable(v) for k, v in properties.items()},
               required, **extra)


def scalar(kind: str, default=None, description: str | None = None, **extra) -> dict:
    schema = {"type": kind, **extra}
    if default is not None:
        schema["default"] = default
    return schema | ({"description": description} if description else {})


def string(description: str | None = None, default: str | None = None, **extra) -> dict:
    return scalar("string", default, description, **extra)


boolean = functools.partial(scalar, "boolean")
integer = functools.partial(scalar, "integer")
number = functools.partial(scalar, "number")


def array(items: dict, **extra) -> dict:
    return {"type": "array", "items": items, **extra}


def json_body(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


# ------------------------------------------------------------------ request schemas
# A schema's maximum that depends on the served model: set by `limited` from its Limits.
LIMIT = "x-jaxllm-limit"
TOKEN_ID = integer(None, "Below the model's vocabulary size.", minimum=0, **{LIMIT: "vocab"})
# The prompt takes one token at least, so max_tokens stays below the context length.
MAX_TOKENS = {"minimum": 1, LIMIT: "context"}
STOP_STRING = string(minLength=1, maxLength=protocol.MAX_STOP_CHARS)

SAMPLING = {
    "n": integer(1, "Samples per prompt, at most the server's --max-num-seqs; 1 when "
                    "temperature is 0.", minimum=1, **{LIMIT: "seqs"}),
    "best_of": integer(None, "Accepted only when equal to n.", minimum=1, **{LIMIT: "seqs"}),
    "temperature": number(1.0, "0 samples greedily.", minimum=0),
    "top_p": number(1.0, exclusiveMinimum=0, maximum=1),
    "top_k": integer(0, "0 or -1 turns it off.", minimum=-1, maximum=protocol.MAX_TOP_K),
    "min_p": number(0.0, minimum=0, maximum=1),
    "repetition_penalty": number(1.0, exclusiveMinimum=0, maximum=2),
    "presence_penalty": number(0.0, minimum=-2, maximum=2),
    "frequency_penalty": number(0.0, minimum=-2, maximum=2),
    "seed": integer(None, minimum=-INT64, maximum=INT64 - 1),
    "stop": {"anyOf": [STOP_STRING, array(STOP_STRING, maxItems=MAX_STOP)]},
    "stop_token_ids": array(TOKEN_ID, maxItems=MAX_STOP),
    "include_stop_str_in_output": boolean(False),
    "ignore_eos": boolean(False),
    "min_tokens": integer(0, "At most max_tokens.", minimum=0),
    "skip_special_tokens": boolean(True),
}
CONSTRAINTS = {  # at most one of these per request (400 otherwise)
    "response_format": ref("ResponseFormat"),
    "structured_outputs": ref("StructuredOutputs"),
    # vLLM's older names (removed there in 0.12), still honoured here.
    "guided_json": {"anyOf": [{"type": "object"}, string("A JSON schema as JSON text.")],
                    "deprecated": True, "description": "Use structured_outputs.json."},
    "guided_regex": string("Use structured_outputs.regex.", deprecated=True),
    "guided_choice": array(string(minLength=1), minItems=1, deprecated=True,
                           description="Use structured_outputs.choice."),
    "guided_grammar": string("Use structured_outputs.grammar.", deprecated=True),
    "guided_decoding_backend": {"enum": list(constraints.GRAMMAR_BACKENDS), "default": "auto",
                                "description": "The grammar engine is always llguidance."},
}


def common(model_names: Sequence[str]) -> dict:
    return {
        "model": {"enum": list(model_names), "description": "A served model name (404 "
                  "otherwise); absent means the first one."},
        "stream": boolean(False),
        "user": string(description="Accepted and unused, as OpenAI's."),
        "stream_options": obj({"include_usage": nullable(boolean(False)),
                               "continuous_usage_stats": nullable(boolean(False))},
                              description="Only with stream=true."),
        "priority": integer(0, "Lower runs first; other than 0 needs the server's "
                               "--scheduling-policy priority.", minimum=-INT64,
                            maximum=INT64 - 1),
        "truncate_prompt_tokens": integer(None, "Keep only the prompt's last k tokens.",
                                          minimum=1),
        "return_tokens_as_token_ids": boolean(False, 'Logprob tokens as "token_id:<id>".'),
    }


def completion_request(model_names: Sequence[str]) -> dict:
    ids = array(TOKEN_ID, minItems=1)
    prompt = {"anyOf": [string(minLength=1), ids,
                        array(string(minLength=1), minItems=1, maxItems=protocol.MAX_PROMPTS),
                        array(ids, minItems=1, maxItems=protocol.MAX_PROMPTS)],
              "description": "A string, a list of strings, token ids, or a list of token id "
                             "lists (not a mix of strings and lists)."}
    return request({
        "prompt": prompt, **common(model_names),
        "max_tokens": integer(16, **MAX_TOKENS),
        "echo": boolean(False, "Not together with logprobs."),
        "logprobs": integer(None, "Top alternatives per output token.", minimum=0,
                            maximum=MAX_LOGPROBS),
        "add_special_tokens": boolean(True),
        **SAMPLING, **CONSTRAINTS,
    }, ["prompt"], description=REFUSED + " use_beam_search=true is refused too.")


def chat_request(model_names: Sequence[str]) -> dict:
    return request({
        "messages": array(ref("ChatMessage"), minItems=1), **common(model_names),
        "max_completion_tokens": integer(None, "Default: up to the context length.",
                                         **MAX_TOKENS),
        "max_tokens": integer(None, "Older name of max_completion_tokens.", **MAX_TOKENS),
        "logprobs": boolean(False),
        "top_logprobs": integer(None, "Needs logprobs=true.", minimum=0, maximum=MAX_LOGPROBS),
        "tools": array(ref("Tool"), maxItems=MAX_TOOLS,
                       description="Functions with distinct names."),
        "tool_choice": ref("ToolChoice"),
        "parallel_tool_calls": boolean(True),
        "add_special_tokens": boolean(False),
        "add_generation_prompt": boolean(True),
        "continue_final_message": boolean(False, "Not with add_generation_prompt=true."),
        "chat_template_kwargs": obj(
            {}, additionalProperties={"type": ["string", "number", "boolean"]},
            propertyNames={"not": {"enum": sorted(protocol.RESERVED_TEMPLATE_KWARGS)}},
            description="Extra variables for the chat template."),
        **SAMPLING, **CONSTRAINTS,
    }, ["messages"], description=REFUSED)


def message_schemas() -> dict:
    part = obj({"type": {"const": "text"}, "text": string()}, ["type", "text"])
    content = {"anyOf": [string(), array(part)], "description": "Text, or a list of text "
               "parts (joined with newlines); other part types are refused."}
    name = nullable(string("Passed to the chat template."))
    call = obj({"id": string(), "type": {"const": "function"},
                "function": obj({"name": string(), "arguments": string(
                    "The arguments as JSON text.", default="")}, ["name"])}, ["function"])
    text_roles = [r for r in protocol.CHAT_ROLES if r not in ("assistant", "tool")]
    return {
        "TextMessage": obj({"role": {"enum": text_roles}, "content": content, "name": name},
                           ["role", "content"]),
        "AssistantMessage": obj({"role": {"const": "assistant"}, "content": nullable(content),
                                 "name": name, "tool_calls": nullable(array(call))}, ["role"]),
        "ToolMessage": obj({"role": {"const": "tool"}, "content": content, "name": name,
                            "tool_call_id": nullable(string())}, ["role", "content"]),
        "ChatMessage": {
            "oneOf": [ref("TextMessage"), ref("AssistantMessage"), ref("ToolMessage")],
            "discriminator": {"propertyName": "role", "mapping": {
                **{r: "#/components/schemas/TextMessage" for r in text_roles},
                "assistant": "#/components/schemas/AssistantMessage",
                "tool": "#/components/schemas/ToolMessage"}}},
    }


def tool_schemas() -> dict:
    function = obj({"name": string(minLength=1),
                    "description": nullable(string()),
                    "parameters": {"type": "object", "default": {"type": "object"},
                                   "description": "A JSON schema for the arguments."}},
                   ["name"])
    named = obj({"type": {"const": "function"},
                 "function": obj({"name": string("One of tools.")}, ["name"])},
                ["type", "function"])
    return {
        "Tool": obj({"type": {"const": "function", "default": "function"},
                     "function": function}, ["function"]),
        "ToolChoice": {"anyOf": [{"enum": ["none", "auto", "required"]}, named],
                       "description": 'Default "auto" when tools are given. "auto" needs '
                                      "--enable-auto-tool-choice; required and a named "
                                      "function constrain the output (not with another "
                                      "output constraint)."},
    }


def constraint_schemas() -> dict:
    kinds = ("json", "regex", "choice", "grammar")
    exactly_one = [{"required": [k], "properties": {k: {"not": {"type": "null"}}}}
                   for k in kinds] + [{"required": ["json_object"],
                                       "properties": {"json_object": {"const": True}}}]
    json_schema = obj({"name": nullable(string()), "description": nullable(string()),
                       "strict": nullable(boolean(False)),
                       "schema": nullable({"type": "object", "description": "Absent: any "
                                           "JSON object."})})
    return {
        "ResponseFormat": {"oneOf": [
            obj({"type": {"const": "text", "default": "text"}}),
            obj({"type": {"const": "json_object"}}, ["type"]),
            obj({"type": {"const": "json_schema"}, "json_schema": json_schema},
                ["type", "json_schema"])]},
        "StructuredOutputs": obj({
            "json": nullable({"anyOf": [{"type": "object"}, string()],
                              "description": "A JSON schema, or its JSON text."}),
            "regex": nullable(string()),
            "choice": nullable(array(string(minLength=1), minItems=1)),
            "grammar": nullable(string("Lark or GBNF/EBNF.")),
            "json_object": nullable(boolean(False)),
            "disable_any_whitespace": nullable(boolean(False)),
        }, additionalProperties=False, oneOf=exactly_one,
            description="Exactly one of json, regex, choice, grammar, json_object."),
    }


# ----------------------------------------------------------------- response schemas
def response_schemas() -> dict:
    finish = {"enum": ["stop", "length", "abort", "tool_calls"]}
    stop_reason = {"type": ["integer", "string", "null"],
                   "description": "The stop string or stop token id that matched."}
    head = {"id": string(), "created": {"type": "integer"}, "model": string()}
    top = obj({"token": string(), "logprob": {"type": "number"},
               "bytes": array({"type": "integer"})}, ["token", "logprob", "bytes"])
    chat_logprobs = nullable(obj({"content": array(obj(
        {**top["properties"], "top_logprobs": array(top)},
        ["token", "logprob", "bytes", "top_logprobs"]))}, ["content"]))
    completion_logprobs = nullable(obj({
        "tokens": array(string()), "token_logprobs": array({"type": "number"}),
        "top_logprobs": array({"type": "object", "additionalProperties": {"type": "number"}}),
        "text_offset": array({"type": "integer"})},
        ["tokens", "token_logprobs", "top_logprobs", "text_offset"]))
    call = obj({"id": string(), "type": {"const": "function"},
                "function": obj({"name": string(), "arguments": string()},
                                ["name", "arguments"])}, ["id", "type", "function"])
    delta_call = obj({"index": {"type": "integer"}, "id": string(),
                      "type": {"const": "function"},
                      "function": obj({"name": string(), "arguments": string()})}, ["index"])

    def response(kind: str, choice: dict, required: list[str], usage: dict) -> dict:
        return obj({**head, "object": {"const": kind}, "choices": array(obj(choice, required)),
                    "usage": usage}, [*head, "object", "choices"])

    text_choice = {"index": {"type": "integer"}, "text": string(),
                   "logprobs": completion_logprobs, "stop_reason": stop_reason}
    return {
        "Usage": obj({k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens",
                                                        "total_tokens")},
                     ["prompt_tokens", "completion_tokens", "total_tokens"]),
        "Completion": response("text_completion", {**text_choice, "finish_reason": finish},
                               ["index", "text", "logprobs", "finish_reason"], ref("Usage")),
        "CompletionChunk": response(
            "text_completion", {**text_choice, "finish_reason": nullable(finish)},
            ["index", "text", "finish_reason"], nullable(ref("Usage"))),
        "ChatCompletion": response("chat.completion", {
            "index": {"type": "integer"}, "logprobs": chat_logprobs, "finish_reason": finish,
            "stop_reason": stop_reason,
            "message": obj({"role": {"const": "assistant"}, "content": nullable(string()),
                            "tool_calls": array(call)}, ["role", "content"])},
            ["index", "message", "finish_reason"], ref("Usage")),
        "ChatCompletionChunk": response("chat.completion.chunk", {
            "index": {"type": "integer"}, "logprobs": chat_logprobs,
            "finish_reason": nullable(finish), "stop_reason": stop_reason,
            "delta": obj({"role": {"const": "assistant"}, "content": string(),
                          "tool_calls": array(delta_call)})},
            ["index", "delta"], nullable(ref("Usage"))),
        "Model": obj({"id": string(), "object": {"const": "model"},
                      "created": {"type": "integer"}, "owned_by": string(),
                      "root": string(), "parent": {"type": "null"},
                      "max_model_len": {"type": "integer"}, "permission": array({})},
                     ["id", "object", "created", "owned_by"]),
        "ModelList": obj({"object": {"const": "list"}, "data": array(ref("Model"))},
                         ["object", "data"]),
        "ErrorResponse": obj({"error": obj({
            "message": string(), "param": nullable(string("The request field at fault.")),
            "type": {"enum": sorted({*ERROR_TYPES.values(), "Error"})},
            "code": {"type": "integer", "description": "The HTTP status."}},
            ["message", "type", "param", "code"])}, ["error"]),
    }


# ------------------------------------------------------- tokenize and embedding schemas
def tokenize_schemas(model_names: Sequence[str]) -> dict:
    model = common(model_names)["model"]
    return {
        "TokenizeRequest": {"anyOf": [
            request({"model": model, "prompt": string(minLength=1),
                     "add_special_tokens": boolean(True)}, ["prompt"]),
            request({"model": model, "messages": array(ref("ChatMessage"), minItems=1),
                     "add_special_tokens": boolean(False),
                     "add_generation_prompt": boolean(True)}, ["messages"])]},
        "DetokenizeRequest": request({"model": model, "tokens": array(TOKEN_ID)},
                                     ["tokens"]),
    }


def embedding_schemas(model_names: Sequence[str]) -> dict:
    ids = array(TOKEN_ID, minItems=1)
    number_list = array({"type": "number"})
    return {
        "EmbeddingRequest": request({
            "input": {"anyOf": [string(minLength=1), ids, array(
                {"anyOf": [string(minLength=1), ids]}, minItems=1,
                maxItems=protocol.MAX_PROMPTS)], "description": "One embedding per string "
                      "or token id list."},
            "model": common(model_names)["model"],
            "encoding_format": {"enum": ["float", "base64"], "default": "float",
                                "description": "base64: little-endian float32 bytes."},
            "normalize": boolean(None, "L2-normalize (default: the server's "
                                       "--pooler-config)"),
            "priority": common(model_names)["priority"],
            "truncate_prompt_tokens": common(model_names)["truncate_prompt_tokens"],
            "add_special_tokens": boolean(True), "user": string(),
        }, ["input"], description="dimensions and messages are refused (400)."),
        "EmbeddingList": obj({
            "id": string(), "object": {"const": "list"}, "created": {"type": "integer"},
            "model": string(),
            "data": array(obj({"object": {"const": "embedding"}, "index": {"type": "integer"},
                               "embedding": {"anyOf": [number_list, string()]}},
                              ["object", "index", "embedding"])),
            "usage": obj({"prompt_tokens": {"type": "integer"},
                          "total_tokens": {"type": "integer"}},
                         ["prompt_tokens", "total_tokens"])},
            ["object", "data", "model", "usage"]),
    }
