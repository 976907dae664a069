"""What agent frameworks send, through the official ``openai`` client against a live server of
the real SmolLM2 (CPU): JSON-schema responses that always validate (a set of schemas sampled
at temperature 1, streamed or not), regex and choice constraints, tool calls with every
``tool_choice``, a multi-turn exchange with a tool result, and bad constraints refused with
400."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import numpy as np
import openai
import pytest
import requests
from conftest import assert_engine_idle
from jaxllm.serve.args import ServerConfig, read_chat_template
from jaxllm.serve.protocol import parse_chat
from jaxllm.serve.server import BackgroundServer
from test_structured_outputs import SCHEMAS

from jaxllm import AsyncLLMEngine

pytestmark = pytest.mark.slow

MODEL = "smollm2"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "languages": {"type": "array", "maxItems": 2, "items": {"enum": ["en", "fr", "de"]}}},
    "required": ["name", "age", "languages"], "additionalProperties": False}
# Bounded arguments (enums), so that even a sampled call ends well inside max_tokens and the
# prompt fits the shared engine's 256-token context.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_llm):
    config = ServerConfig(host="127.0.0.1", port=0, served_model_name=(MODEL,),
                          disable_log_requests=True, disable_log_stats=True,
                          chat_template=read_chat_template("chatml_hermes_tools"),
                          enable_auto_tool_choice=True, tool_call_parser="hermes")
    with BackgroundServer(AsyncLLMEngine(smollm2_llm.engine), config) as s:
        yield s
    assert_engine_idle(smollm2_llm.engine)
    assert smollm2_llm.engine.structured.num_matchers == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def person_format():
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def test_json_schema_responses_validate_at_temperature_1(client):
    messages = [{"role": "user", "content": "Describe it as JSON."}]
    for seed, schema in enumerate([PERSON, *SCHEMAS]):
        out = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=1.0, seed=seed, max_tokens=60,
            n=2 if schema is PERSON else 1,
            response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                    "schema": schema}})
        for choice in out.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), schema)
    # Streamed: the concatenated deltas are the same document, and valid.
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=1.0, seed=7, max_tokens=60, stream=True,
        response_format=person_format())
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=1.0, seed=7, max_tokens=60,
        response_format=person_format())
    assert whole.choices[0].message.content == text


def test_completions_take_structured_outputs_and_guided_fields(client):
    phone = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=20, temperature=1.0, seed=1,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{3}-\d{4}", phone.choices[0].text)
    color = client.completions.create(
        model=MODEL, prompt="My favourite colour is", max_tokens=10, temperature=1.0, seed=2,
        extra_body={"guided_choice": ["red", "green", "blue"]})
    assert color.choices[0].text in ("red", "green", "blue")
    obj = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=40,
                                    temperature=0.7, seed=3,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].text), dict)


def test_named_and_required_tool_choices_always_parse(client):
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], temperature=1.0, seed=4,
        max_tokens=45, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER_TOOL["function"]["parameters"])
    required = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], temperature=1.0, seed=0,
        max_tokens=45, tool_choice="required", parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_streamed_tool_calls_assemble_to_the_whole_response(client):
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER_TOOL], temperature=0,
                max_tokens=50, tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls[0]
    names, arguments, ids = [], "", set()
    for chunk in client.chat.completions.create(**args, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert delta.index == 0
            ids.add(delta.id) if delta.id else None
            if delta.function.name:
                names.append(delta.function.name)
            arguments += delta.function.arguments or ""
    assert names == ["get_weather"] and len(ids) == 1
    assert arguments == whole.function.arguments


def test_a_tool_result_goes_back_through_the_template(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER_TOOL], temperature=0, max_tokens=50,
        tool_choice="required")
    calls = first.choices[0].message.tool_calls
    assert calls, first.choices[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        c.model_dump() for c in calls]}] + [
        {"role": "tool", "tool_call_id": c.id, "content": "18 degrees and sunny"}
        for c in calls]
    reply = client.chat.completions.create(model=MODEL, messages=history,
                                           tools=[WEATHER_TOOL], tool_choice="none",
                                           temperature=0, max_tokens=30)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content  # a plain answer
    auto = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL],
                                          temperature=0, max_tokens=30)  # "auto": parsed
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


BAD = [
    ("invalid schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}}},
     "response_format"),
    ("bad regex", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("grammar cannot compile", {"structured_outputs": {"grammar": "start: missing_rule"}},
     "structured_outputs"),
    # Found by the long fuzz run (2026-12-02): a non-boolean flag reached the grammar cache's
    # hash and gave a 500.
    ("flag not a boolean", {"structured_outputs": {"json_object": [1]}}, "structured_outputs"),
    ("whitespace flag not a boolean", {"structured_outputs": {
        "regex": "a+", "disable_any_whitespace": {"x": 1}}}, "structured_outputs"),
    ("two constraints", {"guided_regex": "a+", "response_format": {"type": "json_object"}},
     "guided_regex"),
    ("unknown tool", {"tools": [WEATHER_TOOL], "tool_choice": {
        "type": "function", "function": {"name": "launch_rockets"}}}, "tool_choice"),
    ("bad tools", {"tools": [{"type": "function", "function": {}}]}, "tools"),
]


@pytest.mark.parametrize("name, extra, param", BAD, ids=[b[0] for b in BAD])
def test_bad_constraints_get_400_with_an_openai_error(client, smollm2_llm, name, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                       extra_body=extra)
    error = info.value.body
    assert error["type"] == "BadRequestError" and error["param"] == param, error
    assert smollm2_llm.engine.get_num_unfinished_requests() == 0


def test_auto_tool_choice_needs_the_servers_parser():
    body = {"messages": ASK, "tools": [WEATHER_TOOL]}
    with pytest.raises(Exception, match="requires --enable-auto-tool-choice"):
        parse_chat(body, vocab_size=100, max_n=4)
    assert parse_chat(body, vocab_size=100, max_n=4, auto_tools=True).tools.choice == "auto"


EMBEDDED = np.load(os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_embeddings.npz"))
PARITY = {p["name"]: p for p in json.load(open(os.path.join(
    os.path.dirname(__file__), "fixtures", "smollm2_parity.json")))["prompts"]}
# The prompts that fit the shared engine's 256-token context.
FITS = [i for i, name in enumerate(EMBEDDED["names"]) if PARITY[name]["num_prompt_tokens"] < 256]


def unit(v):
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


def test_embeddings_match_hugging_face_through_the_openai_client(client):
    """Last-token pooling (the server's default), normalized; the client asks for base64 and
    decodes it; the same request in floats gives the same numbers."""
    texts = [PARITY[EMBEDDED["names"][i]]["text"] for i in FITS]
    got = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in got.data] == list(range(len(texts)))
    assert got.usage.prompt_tokens == sum(PARITY[EMBEDDED["names"][i]]["num_prompt_tokens"]
                                          for i in FITS)
    for i, item in zip(FITS, got.data, strict=True):
        assert len(item.embedding) == 576
        np.testing.assert_allclose(unit(item.embedding), unit(EMBEDDED["last"][i]), atol=2e-4)
    floats = client.embeddings.create(model=MODEL, input=PARITY["short_en"]["prompt_ids"],
                                      encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, got.data[0].embedding, atol=1e-6)


BAD_EMBEDDINGS = [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"),
    ({"input": [1, -2]}, "input"), ({"input": [[49152]]}, "input"),
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "word " * 300}, "input_tokens"),
]


@pytest.mark.parametrize("body, param", BAD_EMBEDDINGS, ids=[b[1] + str(i) for i, b in
                                                             enumerate(BAD_EMBEDDINGS)])
def test_bad_embedding_requests_get_400(server, smollm2_llm, body, param):
    response = requests.post(server.url + "/v1/embeddings", json={"model": MODEL, **body},
                             timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error
    assert smollm2_llm.engine.get_num_unfinished_requests() == 0
    unknown = requests.post(server.url + "/v1/embeddings", json={"model": "x", "input": "hi"},
                            timeout=60)
    assert unknown.status_code == 404
