"""The server's OpenAPI 3.1 document, served at ``GET /openapi.json`` for schema fuzzers
(schemathesis) and client generators.

Written by hand (the component schemas in openapi_schemas.py) from what protocol.py and
tools.py accept and responses.py sends, rather than generated, because the checks live in
plain parsing code; tests/test_openapi.py keeps the two in step (the route table, the fields
the parser accepts, the fields it refuses).

Every optional request field also takes ``null``: the parser reads ``null`` as absent, so a
fuzzer must not expect it to be refused. Cross-field rules the schema cannot express (greedy
needs n=1, at most one output constraint, ...) are in the descriptions and answered with 400.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxllm.serve.openapi_schemas import (
    LIMIT,
    array,
    chat_request,
    completion_request,
    constraint_schemas,
    embedding_schemas,
    json_body,
    message_schemas,
    obj,
    ref,
    response_schemas,
    string,
    tokenize_schemas,
    tool_schemas,
)

# app.OPEN_PATHS, which cannot be imported here (app imports this module through routes);
# test_openapi checks the two agree.
OPEN_PATHS = frozenset({"/health", "/live", "/metrics", "/version", "/openapi.json"})
SSE_NOTE = ("Server-sent events: `data: <{}>` per chunk, then `data: [DONE]`; an error after "
            "the stream began comes as one `data: <ErrorResponse>` event before `[DONE]`.")


# --------------------------------------------------------------------- operations
ERRORS = {  # status -> (component name, why)
    400: ("BadRequest", "The request is invalid; `param` names the field."),
    401: ("Unauthorized", "Missing or wrong API key."),
    404: ("NotFound", "No such model."),
    408: ("RequestTimeout", "The body did not arrive within --request-body-timeout."),
    413: ("PayloadTooLarge", "The body is larger than --max-request-body-bytes."),
    429: ("TooManyRequests", "The waiting queue is full (--max-queue-len); retry later."),
    500: ("InternalServerError", "The engine failed while running the request."),
    503: ("ServiceUnavailable", "The server is shutting down, or its engine has stopped."),
}
HEADERS = {401: "WWW-Authenticate", 429: "Retry-After"}


def error_responses() -> dict:
    out = {}
    for status, (name, why) in ERRORS.items():
        out[name] = json_body(ref("ErrorResponse"), why)
        if status in HEADERS:
            out[name]["headers"] = {HEADERS[status]: {"schema": string()}}
    return out


def operation(summary: str, ok: dict, *, tag: str, body: dict | None = None,
              errors: Sequence[int] = (), params: list | None = None) -> dict:
    op = {"summary": summary, "tags": [tag], "responses": {"200": ok}}
    for status in errors:
        op["responses"][str(status)] = {"$ref": f"#/components/responses/{ERRORS[status][0]}"}
    if body is not None:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    return op


def generation(summary: str, request_schema: str, response: str, chunk: str) -> dict:
    ok = json_body(ref(response), f"A {response} object, or a stream of {chunk} objects "
                                  "with stream=true.")
    # OpenAPI 3.1 reads an event stream's schema as one event's (schemathesis checks each
    # event against it); it has no standard way to type the JSON inside `data`.
    ok["content"]["text/event-stream"] = {
        "schema": obj({"data": string("JSON text, or [DONE]."), "event": string(),
                       "id": string(), "retry": {"type": "integer"}}, ["data"],
                      description=SSE_NOTE.format(chunk)),
        "x-event-schema": ref(chunk)}
    return operation(summary, ok, tag="OpenAI", body=ref(request_schema),
                     errors=(400, 404, 408, 413, 429, 500, 503))


def paths(model_names: Sequence[str]) -> dict:
    model_param = {"name": "model", "in": "path", "required": True, "schema": {
        "enum": list(model_names)}, "description": "May contain slashes, raw or percent-encoded."}
    probe = {"description": "OK (empty body)."}
    return {
        "/v1/completions": {"post": generation("Text completion", "CompletionRequest",
                                               "Completion", "CompletionChunk")},
        "/v1/chat/completions": {"post": generation(
            "Chat completion", "ChatCompletionRequest", "ChatCompletion",
            "ChatCompletionChunk")},
        "/v1/embeddings": {"post": operation(
            "Embeddings of the inputs (pooled as the server's --pooler-config says)",
            json_body(ref("EmbeddingList")), tag="OpenAI", body=ref("EmbeddingRequest"),
            errors=(400, 404, 408, 413, 429, 500, 503))},
        "/v1/models": {"get": operation("The served models", json_body(ref("ModelList")),
                                        tag="OpenAI")},
        "/v1/models/{model}": {"get": operation("One served model", json_body(ref("Model")),
                                                tag="OpenAI", errors=(404,),
                                                params=[model_param])},
        "/tokenize": {"post": operation(
            "Token ids of a prompt or of rendered chat messages", json_body(obj(
                {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                 "tokens": array({"type": "integer"})}, ["count", "max_model_len", "tokens"])),
            tag="vLLM", body=ref("TokenizeRequest"), errors=(400, 404, 408, 413))},
        "/detokenize": {"post": operation(
            "Text of token ids", json_body(obj({"prompt": string()}, ["prompt"])),
            tag="vLLM", body=ref("DetokenizeRequest"), errors=(400, 404, 408, 413))},
        "/health": {"get": operation("Ready to generate", probe, tag="Operations",
                                     errors=(503,))},
        "/live": {"get": operation("Alive (draining included)", probe, tag="Operations",
                                   errors=(503,))},
        "/version": {"get": operation("Server version", json_body(
            obj({"version": string()}, ["version"])), tag="Operations")},
        "/metrics": {"get": operation("Prometheus metrics", {
            "description": "Prometheus text exposition format.",
            "content": {"text/plain": {"schema": string()}}}, tag="Operations")},
        "/openapi.json": {"get": operation("This document", json_body({"type": "object"}),
                                           tag="Operations")},
    }


@dataclasses.dataclass(frozen=True)
class Limits:
    """The served model's limits, which bound some fields: token ids below ``vocab_size``,
    max_tokens below ``max_model_len``, n and best_of up to ``max_num_seqs``."""

    max_model_len: int
    max_num_seqs: int
    vocab_size: int

    def maximum(self, kind: str) -> int:
        return {"vocab": self.vocab_size - 1, "context": self.max_model_len - 1,
                "seqs": self.max_num_seqs}[kind]


def limited(node, limits: Limits | None):
    """``node`` with each LIMIT mark replaced by its maximum (dropped without limits)."""
    if isinstance(node, list):
        return [limited(v, limits) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: limited(v, limits) for k, v in node.items() if k != LIMIT}
    if LIMIT in node and limits is not None:
        out["maximum"] = limits.maximum(node[LIMIT])
    return out


def openapi_document(model_names: Sequence[str], version: str, *, auth: bool = False,
                     limits: Limits | None = None) -> dict:
    """The document for a server serving ``model_names``; ``auth``: it runs with --api-key
    (without one no route asks for a key, and a fuzzer would flag a declared one);
    ``limits``: the served model's, as maxima of the fields they bound."""
    document = {
        "openapi": "3.1.0",
        "info": {"title": "jaxllm", "version": version,
                 "description": "An OpenAI-compatible LLM server (vLLM's API subset)."},
        "paths": paths(model_names),
        "components": {
            "schemas": {"CompletionRequest": completion_request(model_names),
                        "ChatCompletionRequest": chat_request(model_names),
                        **message_schemas(), **tool_schemas(), **constraint_schemas(),
                        **tokenize_schemas(model_names), **embedding_schemas(model_names),
                        **response_schemas()},
            "responses": error_responses(),
            "securitySchemes": {"bearerAuth": {
                "type": "http", "scheme": "bearer",
                "description": "The server's --api-key, when it has one."}},
        },
    }
    if auth:
        for path, methods in document["paths"].items():
            if path not in OPEN_PATHS:
                for op in methods.values():
                    op["security"] = [{"bearerAuth": []}]
                    op["responses"]["401"] = {"$ref": "#/components/responses/Unauthorized"}
    return limited(document, limits)
