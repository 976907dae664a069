"""GET /openapi.json: a valid OpenAPI 3.1 document that stays true to the server, checked
against the app's route table, the request parser (documented fields are accepted, refused
ones are not documented) and the response builder (bodies match the documented shapes).
No model is loaded: the app is built over a stub state."""

from __future__ import annotations

import asyncio
import json
import types
from unittest import mock

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer
from jaxllm.serve import app as app_module
from jaxllm.serve import openapi
from jaxllm.serve.args import ServerConfig
from jaxllm.serve.embeddings import parse_embedding, response_body
from jaxllm.serve.errors import ERROR_TYPES, APIError, error_body
from jaxllm.serve.protocol import UNSUPPORTED, GenerationRequest, parse_chat, parse_completion
from jaxllm.serve.responses import ResponseBuilder

import jaxllm
from jaxllm.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

MODEL = "smol"
KEY = "sekret"
VOCAB = 1000
MAX_N = 4
DOC = openapi.openapi_document([MODEL], jaxllm.__version__, auth=True,
                               limits=openapi.Limits(256, MAX_N, VOCAB))
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}


def validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for one component schema; its #/components/... references resolve."""
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                            "components": DOC["components"]})


def valid(name: str, instance) -> bool:
    return validator(name).is_valid(instance)


@pytest.fixture
def app():
    """The real route table and middlewares over a stub state (no engine, no model); one per
    test, as an aiohttp app runs on one event loop only."""
    config = ServerConfig(api_key=KEY, disable_log_stats=True)
    state = types.SimpleNamespace(model_names=(MODEL,), config=config, memory=None, created=1,
                                  max_model_len=256, max_num_seqs=MAX_N, vocab_size=VOCAB,
                                  draining=False, engine_alive=True,
                                  metrics=mock.MagicMock(), tokenizer_pool=mock.MagicMock())
    with mock.patch.object(app_module, "ServerState", lambda engine, config: state):
        return app_module.build_app(None, config)


def registered_routes(app) -> set[tuple[str, str]]:
    # aiohttp adds HEAD to every GET route by itself; the document lists GETs only.
    return {(route.resource.canonical, route.method.lower()) for route in app.router.routes()
            if route.method != "HEAD"}


def documented_routes(document: dict) -> set[tuple[str, str]]:
    return {(path, method) for path, item in document["paths"].items() for method in item}


def operations(document: dict):
    for path, item in document["paths"].items():
        for method, op in item.items():
            yield path, method, op


def test_document_is_valid_openapi_3_1():
    assert DOC["openapi"].startswith("3.1.")
    assert DOC["info"]["version"] == jaxllm.__version__
    validate = pytest.importorskip("openapi_spec_validator").validate
    validate(DOC)
    validate(openapi.openapi_document(["a", "b"], "0", auth=False))


def test_every_registered_route_is_documented_with_its_methods(app):
    assert registered_routes(app) == documented_routes(DOC)
    assert ("/openapi.json", "get") in registered_routes(app)


def test_served_without_the_api_key_and_other_routes_still_need_it(app):
    async def fetch():
        async with TestClient(TestServer(app)) as client:
            served = await client.get("/openapi.json")
            models = await client.get("/v1/models")
            return served.status, await served.json(), models.status, await models.json()

    status, body, models_status, models_body = asyncio.run(fetch())
    assert status == 200 and body == DOC
    assert models_status == 401 and valid("ErrorResponse", models_body)


def response_validator(path: str, status: int) -> jsonschema.Draft202012Validator:
    response = DOC["paths"][path]["get"]["responses"][str(status)]
    if "$ref" in response:
        response = DOC["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
    return jsonschema.Draft202012Validator(
        response["content"]["application/json"]["schema"] | {"components": DOC["components"]})


def test_the_small_routes_answer_as_documented(app):
    async def fetch(client, path):
        response = await client.get(path, headers={"Authorization": f"Bearer {KEY}"})
        return response.status, await response.read()

    async def check():
        async with TestClient(TestServer(app)) as client:
            for path, route, status in (("/v1/models", "/v1/models", 200),
                                        (f"/v1/models/{MODEL}", "/v1/models/{model}", 200),
                                        ("/v1/models/other", "/v1/models/{model}", 404),
                                        ("/version", "/version", 200)):
                code, body = await fetch(client, path)
                assert code == status, path
                response_validator(route, status).validate(json.loads(body))
            assert await fetch(client, "/health") == (200, b"")

    asyncio.run(check())


def test_security_is_declared_exactly_where_the_key_is_checked():
    assert openapi.OPEN_PATHS == app_module.OPEN_PATHS
    for path, _, op in operations(DOC):
        secured = path not in app_module.OPEN_PATHS
        assert ("security" in op) == secured, path
        assert ("401" in op["responses"]) == secured, path
    unsecured = openapi.openapi_document([MODEL], "0", auth=False)
    assert not any("security" in op or "401" in op["responses"]
                   for _, _, op in operations(unsecured))


def test_every_error_response_is_the_error_body():
    responses = DOC["components"]["responses"]
    for path, method, op in operations(DOC):
        for status, response in op["responses"].items():
            if int(status) >= 400:
                name = response["$ref"].rsplit("/", 1)[1]
                schema = responses[name]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (path, method)
    for status in [*ERROR_TYPES, 418]:
        assert valid("ErrorResponse", error_body("boom", status, "prompt"))
        assert valid("ErrorResponse", error_body("boom", status))
    assert not valid("ErrorResponse", {"error": {"message": "boom"}})


def test_generation_routes_document_streaming():
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = DOC["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}


# One body fragment per documented request field (with what it needs, e.g. logprobs for
# top_logprobs). A field added to the document without a sample here fails the test.
SAMPLING_SAMPLES = {
    "n": {"n": 2}, "best_of": {"n": 2, "best_of": 2}, "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9}, "top_k": {"top_k": -1}, "min_p": {"min_p": 0.1},
    "repetition_penalty": {"repetition_penalty": 1.2}, "presence_penalty": {
        "presence_penalty": -2}, "frequency_penalty": {"frequency_penalty": 2},
    "seed": {"seed": -(2**63)}, "stop": {"stop": ["\n", "x" * 256]},
    "stop_token_ids": {"stop_token_ids": [0, VOCAB - 1]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True}, "min_tokens": {"min_tokens": 2, "max_tokens": 4},
    "skip_special_tokens": {"skip_special_tokens": False},
    "model": {"model": MODEL}, "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True,
                                                          "continuous_usage_stats": True}},
    "priority": {"priority": 2**63 - 1}, "truncate_prompt_tokens": {"truncate_prompt_tokens": 1},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "response_format": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"],
                                                  "disable_any_whitespace": True}},
    "guided_json": {"guided_json": '{"type": "object"}'}, "guided_regex": {"guided_regex": "a+"},
    "guided_choice": {"guided_choice": ["a", "b"]}, "guided_grammar": {
        "guided_grammar": 'start: "a"'},
    "guided_decoding_backend": {"guided_decoding_backend": "llguidance"},
    "max_tokens": {"max_tokens": 3}, "user": {"user": "u"},
}
CHAT_SAMPLES = SAMPLING_SAMPLES | {
    "messages": {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}], "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "Sunny.", "tool_call_id": "call_1"}]},
    "max_completion_tokens": {"max_completion_tokens": 5}, "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 20}, "tools": {"tools": [TOOL]},
    "tool_choice": {"tools": [TOOL], "tool_choice": "none"},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "add_special_tokens": {"add_special_tokens": True},
    "add_generation_prompt": {"add_generation_prompt": True},
    "continue_final_message": {"add_generation_prompt": False, "continue_final_message": True},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
}
COMPLETION_SAMPLES = SAMPLING_SAMPLES | {
    "prompt": {"prompt": [[1], [1, 2]]}, "echo": {"echo": True}, "logprobs": {"logprobs": 0},
    "add_special_tokens": {"add_special_tokens": False},
}
EMBEDDING_SAMPLES = {
    "input": {"input": ["a", [1, 2]]}, "model": {"model": MODEL},
    "encoding_format": {"encoding_format": "base64"}, "normalize": {"normalize": False},
    "priority": {"priority": 1}, "truncate_prompt_tokens": {"truncate_prompt_tokens": 4},
    "add_special_tokens": {"add_special_tokens": False}, "user": {"user": "u"},
}
PARSERS = {  # samples, a minimal body, the parser, the fields it refuses
    "ChatCompletionRequest": (CHAT_SAMPLES, {"messages": USER}, lambda body: parse_chat(
        body, vocab_size=VOCAB, max_n=MAX_N, auto_tools=True), UNSUPPORTED),
    "CompletionRequest": (COMPLETION_SAMPLES, {"prompt": "hi"}, lambda body: parse_completion(
        body, vocab_size=VOCAB, max_n=MAX_N), (*UNSUPPORTED, "use_beam_search")),
    "EmbeddingRequest": (EMBEDDING_SAMPLES, {"input": "hi"}, lambda body: parse_embedding(
        body, vocab_size=VOCAB, pooler=PoolingParams()), ("dimensions", "messages")),
}


@pytest.mark.parametrize("name", PARSERS)
def test_documented_request_fields_are_the_ones_the_parser_accepts(name):
    samples, base, parse, refused = PARSERS[name]
    schema = DOC["components"]["schemas"][name]
    assert set(schema["properties"]) == set(samples)
    for field, fragment in samples.items():
        body = base | fragment
        parse(body)  # raises APIError if the parser refuses a documented field
        assert valid(name, body), field
        if field not in schema["required"]:  # null counts as absent, in both
            parse(base | {field: None})
            assert valid(name, base | {field: None}), field
    for field in refused:
        assert field not in schema["properties"]
        assert field in schema["description"]
        with pytest.raises(APIError):
            parse(base | {field: True})


CHAT_REFUSED = {
    "temperature as a string": {"temperature": "hot"},
    "top_p of 0": {"top_p": 0},
    "negative min_tokens": {"min_tokens": -1},
    "logprobs as a number": {"logprobs": 2},
    "too many top_logprobs": {"logprobs": True, "top_logprobs": 21},
    "no messages": {"messages": []},
    "an unknown role": {"messages": [{"role": "robot", "content": "hi"}]},
    "an image part": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]},
    "a user message without content": {"messages": [{"role": "user"}]},
    "an empty stop string": {"stop": ""},
    "65 stop strings": {"stop": ["x"] * 65},
    "a negative stop token": {"stop_token_ids": [-1]},
    "two kinds in structured_outputs": {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    "an unknown structured_outputs key": {"structured_outputs": {"regex": "a", "lark": "b"}},
    "an unknown response_format": {"response_format": {"type": "xml"}},
    "json_schema without its object": {"response_format": {"type": "json_schema"}},
    "an unknown grammar backend": {"guided_decoding_backend": "xgrammar"},
    "a tool without a name": {"tools": [{"type": "function", "function": {}}]},
    "an unknown tool_choice": {"tools": [TOOL], "tool_choice": "sometimes"},
    "a reserved template kwarg": {"chat_template_kwargs": {"tokenize": True}},
    "stream as a string": {"stream": "yes"},
    "a seed beyond int64": {"seed": 2**63},
    "n past --max-num-seqs": {"n": MAX_N + 1, "temperature": 1},
    "a stop token past the vocabulary": {"stop_token_ids": [VOCAB]},
    # Found by schema fuzzing (tests/test_server_fuzz.py): both were accepted by the parser.
    "a top_k beyond int32": {"top_k": 2**31},
    "a message name that is not a string": {"messages": [{"role": "user", "content": "hi",
                                                          "name": 3}]},
    "a tool call id that is not a string": {"messages": [{"role": "assistant", "tool_calls": [
        {"id": {}, "function": {"name": "f", "arguments": "{}"}}]}]},
    # Found by the long fuzz run: max_tokens went unchecked beside max_completion_tokens, and
    # a guided_choice string was read as the list of its characters.
    "max_tokens of 0 beside max_completion_tokens": {"max_tokens": 0,
                                                     "max_completion_tokens": 2},
    "max_tokens as a string beside max_completion_tokens": {"max_tokens": "",
                                                            "max_completion_tokens": 2},
    "guided_choice as a string": {"guided_choice": "yes"},
    "structured_outputs.choice as a string": {"structured_outputs": {"choice": "yes"}},
    # Found by long run 2: the json_schema's name, description and strict went unchecked.
    "a json_schema name that is not a string": {"response_format": {
        "type": "json_schema", "json_schema": {"name": False, "schema": {"type": "object"}}}},
    "a json_schema description that is not a string": {"response_format": {
        "type": "json_schema", "json_schema": {"description": [0]}}},
    "a json_schema strict that is not a boolean": {"response_format": {
        "type": "json_schema", "json_schema": {"strict": "yes"}}},
    "tool calls that are not a list": {"messages": [{"role": "assistant", "tool_calls": 0}]},
    "a tool call of another type": {"messages": [{"role": "assistant", "tool_calls": [
        {"type": "custom", "function": {"name": "f", "arguments": "{}"}}]}]},
}


def test_sample_bodies_validate_as_the_parser_decides():
    parse = PARSERS["ChatCompletionRequest"][2]
    for case, fragment in CHAT_REFUSED.items():
        body = {"messages": USER} | fragment
        assert not valid("ChatCompletionRequest", body), case
        with pytest.raises(APIError):
            parse(body)
    assert not valid("ChatCompletionRequest", {"messages": USER, "model": "other"})
    assert not valid("ChatCompletionRequest", {"model": MODEL})
    accepted = {"messages": USER, "tools": [TOOL], "tool_choice": "none", "temperature": 0,
                "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
                "response_format": {"type": "json_object"}, "unknown_field": 1}
    assert valid("ChatCompletionRequest", accepted)
    parse(accepted)
    for prompt in ("hi", ["a", "b"], [1, 2], [[1], [2, 3]]):
        assert valid("CompletionRequest", {"prompt": prompt}), prompt
    for prompt in ("", [], ["a", 1], ["a", [1, 2]], [-1], ["x"] * 129, {"text": "hi"}):
        assert not valid("CompletionRequest", {"prompt": prompt}), prompt
    assert valid("TokenizeRequest", {"prompt": "hi"})
    assert valid("TokenizeRequest", {"messages": USER, "add_generation_prompt": False})
    assert not valid("TokenizeRequest", {"prompt": ""})
    assert valid("DetokenizeRequest", {"tokens": [1, 2]})
    assert not valid("DetokenizeRequest", {"tokens": [-1]})


def output(text: str, token_ids: list[int], finish: str | None) -> RequestOutput:
    logprobs = [{t: -0.5, t + 1: -1.0} for t in token_ids]
    return RequestOutput("r", "hi", [1, 2], [CompletionOutput(0, text, token_ids, -1.0,
                                                               logprobs, finish)],
                         finish is not None, metrics=None)


@pytest.mark.parametrize("chat", [False, True])
def test_response_bodies_match_the_documented_shapes(chat):
    req = GenerationRequest(chat=chat, model=None, params=SamplingParams(logprobs=1),
                            top_logprobs=1 if chat else None, stream=True,
                            include_usage=True, continuous_usage_stats=True)
    kind = "ChatCompletion" if chat else "Completion"

    def builder() -> ResponseBuilder:
        return ResponseBuilder(req, "id-1", MODEL, [2], ["hi"], lambda t: f"<{t}>")

    whole = builder()
    whole.add(0, output("a", [5], None))
    whole.add(0, output("b", [6], "length"))
    assert valid(kind, whole.full())
    streamer = builder()
    chunks = [*streamer.first_chunks(), *streamer.deltas(0, output("a", [5], None)),
              *streamer.deltas(0, output("b", [6], "stop")), streamer.usage_chunk()]
    for chunk in chunks:
        assert valid(kind + "Chunk", chunk), chunk


def test_embedding_response_matches_the_documented_shape():
    outs = [EmbeddingRequestOutput(str(i), None, [1, 2], EmbeddingOutput([0.6, -0.8]), True,
                                   None) for i in range(2)]
    for encoding in ("float", "base64"):
        req = parse_embedding({"input": ["a", [1, 2]], "encoding_format": encoding},
                              vocab_size=VOCAB, pooler=PoolingParams())
        body = response_body("embd-1", MODEL, req, [[1, 2], [3]], outs)
        assert valid("EmbeddingList", body), body
        assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
