"""The OpenAI-compatible server against a live in-process instance on 127.0.0.1 (SmolLM2 on
CPU): the official ``openai`` client, SSE framing, a table of bad inputs, overload (429),
client disconnects (aborts free every KV block), metrics and auth."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time

import aiohttp
import openai
import pytest
from conftest import assert_engine_idle
from jaxllm.serve.args import ServerConfig
from jaxllm.serve.server import BackgroundServer
from prometheus_client.parser import text_string_to_metric_families

from jaxllm import AsyncLLMEngine

pytestmark = pytest.mark.slow

KEY = "test-key"
MODEL = "smollm2"
MAX_MODEL_LEN = 256
BODY_LIMIT = 64 * 1024
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "The three primary colors are"]


@pytest.fixture(scope="module")
def server(smollm2_llm):
    """A server over the run's shared SmolLM2 engine (conftest), left idle afterwards."""
    engine = smollm2_llm.engine
    assert engine.config.max_model_len == MAX_MODEL_LEN
    config = ServerConfig(host="127.0.0.1", port=0, served_model_name=(MODEL, "alias"),
                          api_key=KEY, max_request_body_bytes=BODY_LIMIT,
                          disable_log_requests=True, stats_interval=1.0, memory_monitor=True,
                          memory_monitor_interval=0.5)
    with BackgroundServer(AsyncLLMEngine(engine), config) as s:
        yield s
    assert_engine_idle(engine)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def request(server, method, path, body=None, key=KEY, headers=None):
    """(status, headers, body bytes) of one raw HTTP request."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if key:
        all_headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=data, headers=all_headers)
    response = conn.getresponse()
    result = response.status, dict(response.getheaders()), response.read()
    conn.close()
    return result


def greedy_text(client, prompt, max_tokens=16):
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def metric_samples(server) -> dict:
    status, _, body = request(server, "GET", "/metrics", key=None)
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def engine_state(server):
    """(unfinished requests?, free blocks, usable blocks), read on the engine thread."""
    def read(engine):
        bm = engine.block_manager
        return engine.has_unfinished_requests(), bm.num_free_blocks, bm.num_gpu_blocks - 1

    return server.call(lambda: server.engine.run_in_engine(read))


def wait_engine_idle(server, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy, free, usable = engine_state(server)
        if not busy:
            return free, usable
        time.sleep(0.05)
    raise AssertionError("the engine still has requests")


# ------------------------------------------------------------------ the openai client
def test_openai_client_completions_stream_equals_non_stream(client):
    prompt = PROMPTS[0]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert "Paris" in full.choices[0].text
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens == 5
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 17
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_client_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                          temperature=0)
    answer = full.choices[0].message
    assert answer.role == "assistant" and "Paris" in answer.content
    assert full.choices[0].finish_reason == "stop" and full.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_client_n_logprobs_stop_and_seed(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, n=2,
                                    temperature=0.8, seed=7, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert all(2 <= len(top) <= 3 and v <= 0 for top in lp.top_logprobs
                   for v in top.values())
        assert "".join(lp.tokens) == choice.text
    again = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, n=2,
                                      temperature=0.8, seed=7, logprobs=2)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30,
                                        temperature=0, stop=[" 8"])
    assert stopped.choices[0].text == " 5, 6, 7,"
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == " 8"
    chat = client.chat.completions.create(
        model="alias", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, n=2,
        temperature=1.0, logprobs=True, top_logprobs=3)
    assert len(chat.choices) == 2
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())


def test_openai_client_errors(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.param == "temperature" and e.value.type == "BadRequestError"
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    anonymous = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]


# ------------------------------------------------------------------------ wire format
def test_sse_framing_is_exact(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, raw = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 6
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert len({p["id"] for p in payloads}) == 1


def test_small_endpoints(server):
    assert request(server, "GET", "/health", key=None)[:1] == (200,)
    assert request(server, "GET", "/live", key=None)[:1] == (200,)
    status, _, body = request(server, "GET", "/version", key=None)
    assert status == 200 and json.loads(body)["version"]
    status, _, body = request(server, "POST", "/tokenize", {"prompt": "hello world"})
    tokens = json.loads(body)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    status, _, body = request(server, "POST", "/detokenize", {"tokens": tokens["tokens"]})
    assert json.loads(body) == {"prompt": "hello world"}
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert json.loads(request(server, "POST", "/tokenize", chat)[2])["count"] > 5
    assert request(server, "GET", "/v1/models/alias")[0] == 200
    for path, method in [("/tokenize", "POST"), ("/v1/models", "GET")]:
        status, headers, body = request(server, method, path, {}, key=None)
        assert status == 401 and json.loads(body)["error"]["type"] == "AuthenticationError"


# ------------------------------------------------------------------------- bad inputs
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    # (name, path, body, status, error type)
    ("truncated JSON", C, b'{"prompt": "hi",', 400, "BadRequestError"),
    ("array body", C, [1, 2], 400, "BadRequestError"),
    ("string body", C, "hi", 400, "BadRequestError"),
    ("null body", C, None, 400, "BadRequestError"),
    ("invalid UTF-8", C, b'{"prompt": "\xff\xfe"}', 400, "BadRequestError"),
    ("NaN literal", C, b'{"prompt": "hi", "temperature": NaN}', 400, "BadRequestError"),
    ("huge integer", C, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400,
     "BadRequestError"),
    ("no prompt", C, {}, 400, "BadRequestError"),
    ("empty prompt", C, {"prompt": ""}, 400, "BadRequestError"),
    ("empty prompt list", C, {"prompt": []}, 400, "BadRequestError"),
    ("prompt number", C, {"prompt": 5}, 400, "BadRequestError"),
    ("prompt of objects", C, {"prompt": [{"a": 1}]}, 400, "BadRequestError"),
    ("prompt mixing strings and token lists", C, {"prompt": ["a", [1, 2]]}, 400,
     "BadRequestError"),
    ("user that is not a string", C, {"prompt": "hi", "user": 5}, 400, "BadRequestError"),
    ("token id past vocab", C, {"prompt": [999999]}, 400, "BadRequestError"),
    ("negative token id", C, {"prompt": [-1]}, 400, "BadRequestError"),
    ("temperature string", C, {"prompt": "hi", "temperature": "hot"}, 400, "BadRequestError"),
    ("temperature < 0", C, {"prompt": "hi", "temperature": -1}, 400, "BadRequestError"),
    ("top_p 0", C, {"prompt": "hi", "top_p": 0}, 400, "BadRequestError"),
    ("top_p > 1", C, {"prompt": "hi", "top_p": 1.5}, 400, "BadRequestError"),
    ("top_k -2", C, {"prompt": "hi", "top_k": -2}, 400, "BadRequestError"),
    ("top_k float", C, {"prompt": "hi", "top_k": 1.5}, 400, "BadRequestError"),
    # Found by schema fuzzing: a top_k past int32 reached the sampler and killed the engine.
    ("top_k past int32", C, {"prompt": "hi", "top_k": 2**31}, 400, "BadRequestError"),
    ("min_p > 1", C, {"prompt": "hi", "min_p": 2}, 400, "BadRequestError"),
    ("repetition_penalty 0", C, {"prompt": "hi", "repetition_penalty": 0}, 400,
     "BadRequestError"),
    ("presence_penalty 3", C, {"prompt": "hi", "presence_penalty": 3}, 400, "BadRequestError"),
    ("frequency_penalty -3", C, {"prompt": "hi", "frequency_penalty": -3}, 400,
     "BadRequestError"),
    ("n 0", C, {"prompt": "hi", "n": 0}, 400, "BadRequestError"),
    ("n past max_num_seqs", C, {"prompt": "hi", "n": 1000, "temperature": 1}, 400,
     "BadRequestError"),
    ("greedy with n 2", C, {"prompt": "hi", "n": 2, "temperature": 0}, 400, "BadRequestError"),
    ("max_tokens 0", C, {"prompt": "hi", "max_tokens": 0}, 400, "BadRequestError"),
    ("max_tokens string", C, {"prompt": "hi", "max_tokens": "ten"}, 400, "BadRequestError"),
    ("max_tokens past context", C, {"prompt": "hi", "max_tokens": 300}, 400,
     "BadRequestError"),
    ("prompt past context", C, {"prompt": [42] * 300}, 400, "BadRequestError"),
    ("prompt fills context", C, {"prompt": [42] * 256, "max_tokens": None}, 400,
     "BadRequestError"),
    ("logprobs 21", C, {"prompt": "hi", "logprobs": 21}, 400, "BadRequestError"),
    ("logprobs -1", C, {"prompt": "hi", "logprobs": -1}, 400, "BadRequestError"),
    ("min_tokens > max_tokens", C, {"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, 400,
     "BadRequestError"),
    ("empty stop string", C, {"prompt": "hi", "stop": [""]}, 400, "BadRequestError"),
    ("stop number", C, {"prompt": "hi", "stop": 5}, 400, "BadRequestError"),
    ("stop_token_ids past vocab", C, {"prompt": "hi", "stop_token_ids": [10**6]}, 400,
     "BadRequestError"),
    ("seed string", C, {"prompt": "hi", "seed": "x"}, 400, "BadRequestError"),
    ("stream string", C, {"prompt": "hi", "stream": "yes"}, 400, "BadRequestError"),
    ("stream_options without stream", C, {"prompt": "hi", "stream_options":
                                          {"include_usage": True}}, 400, "BadRequestError"),
    ("unknown model", C, {"prompt": "hi", "model": "gpt-4"}, 404, "NotFoundError"),
    ("suffix", C, {"prompt": "hi", "suffix": "end"}, 400, "BadRequestError"),
    ("best_of", C, {"prompt": "hi", "best_of": 3}, 400, "BadRequestError"),
    ("echo with logprobs", C, {"prompt": "hi", "echo": True, "logprobs": 1}, 400,
     "BadRequestError"),
    ("priority without priority policy", C, {"prompt": "hi", "priority": 1}, 400,
     "BadRequestError"),
    ("body over the cap", C, {"prompt": "x" * (BODY_LIMIT + 10)}, 413,
     "RequestEntityTooLargeError"),
    ("unknown route", "/v1/nothing", {}, 404, "NotFoundError"),
    ("no messages", CHAT, {}, 400, "BadRequestError"),
    ("empty messages", CHAT, {"messages": []}, 400, "BadRequestError"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "BadRequestError"),
    ("content number", CHAT, {"messages": [{"role": "user", "content": 3}]}, 400,
     "BadRequestError"),
    ("name number", CHAT, {"messages": [{"role": "user", "content": "hi", "name": 3}]}, 400,
     "BadRequestError"),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "BadRequestError"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400,
     "BadRequestError"),
    ("max_completion_tokens past context", CHAT, {"messages": MSG,
                                                  "max_completion_tokens": 10**6}, 400,
     "BadRequestError"),
    ("tools", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400,
     "BadRequestError"),
    ("request chat template", CHAT, {"messages": MSG, "chat_template": "{{ 7*7 }}"}, 400,
     "BadRequestError"),
    ("template kwarg tokenize", CHAT, {"messages": MSG, "chat_template_kwargs":
                                       {"tokenize": True}}, 400, "BadRequestError"),
    ("unknown response_format", CHAT, {"messages": MSG, "response_format":
                                       {"type": "yaml"}}, 400, "BadRequestError"),
    ("tokenize nothing", "/tokenize", {}, 400, "BadRequestError"),
    ("tokenize a tool call with an object id", "/tokenize", {"messages": [
        {"role": "assistant", "tool_calls": [{"id": {}, "function": {"name": "f"}}]}]}, 400,
     "BadRequestError"),
    ("detokenize negative", "/detokenize", {"tokens": [-5]}, 400, "BadRequestError"),
    ("detokenize past vocab", "/detokenize", {"tokens": [10**7]}, 400, "BadRequestError"),
]


@pytest.mark.parametrize("name,path,body,status,error_type", BAD_INPUTS,
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_its_4xx(server, name, path, body, status, error_type):
    got, headers, raw = request(server, "POST", path,
                                b"null" if body is None else body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert error["type"] == error_type and error["code"] == status and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_top_k_at_its_limit_samples(client):
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, seed=1,
                                    extra_body={"top_k": 2**31 - 1})  # past the vocab: off
    assert out.usage.completion_tokens == 2


def test_context_messages_are_vllms(server):
    _, _, raw = request(server, "POST", C, {"prompt": "hi", "max_tokens": 300})
    assert json.loads(raw)["error"]["message"] == (
        "'max_tokens' or 'max_completion_tokens' is too large: 300. This model's maximum "
        "context length is 256 tokens and your request has 1 input tokens (300 > 256 - 1).")
    _, _, raw = request(server, "POST", C, {"prompt": [42] * 300})
    assert json.loads(raw)["error"]["message"] == (
        "This model's maximum context length is 256 tokens. However, your request has 300 "
        "input tokens. Please reduce the length of the input messages.")


def test_after_bad_inputs_no_500_and_still_correct(server, client):
    for (handler, method, status), value in _http_counts(server).items():
        assert status != "500", (handler, method, value)
    assert "Paris" in greedy_text(client, PROMPTS[0], 8)
    free, usable = wait_engine_idle(server)  # a launched step may still trail the answer
    assert free == usable


def _http_counts(server) -> dict:
    out = {}
    for (name, labels), value in metric_samples(server).items():
        if name == "jaxllm:http_requests_total":
            d = dict(labels)
            out[(d["handler"], d["method"], d["status"])] = value
    return out


# --------------------------------------------------------------------------- overload
def test_overload_gets_429_and_every_request_an_answer(server, client):
    reference = greedy_text(client, PROMPTS[1])
    server.state.admission.limit = 2
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                 timeout=120)

    async def one():
        try:
            out = await aclient.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16,
                                                   temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].text
        except openai.RateLimitError as e:
            assert e.response.headers["Retry-After"] == "1"
            return e

    async def flood():
        return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(24))), 120)

    try:
        results = asyncio.run(flood())
    finally:
        server.state.admission.limit = None
    rejected = [r for r in results if isinstance(r, openai.RateLimitError)]
    accepted = [r for r in results if isinstance(r, str)]
    assert len(rejected) + len(accepted) == 24
    assert rejected and len(accepted) >= 2
    assert all(text == reference for text in accepted)
    assert server.state.admission.pending == 0
    wait_engine_idle(server)


# ------------------------------------------------------------------------ disconnects
STREAMS = 24  # six waves of the engine's 4 sequences
STREAM_TOKENS = 12  # a cancelled stream goes away after its second event
# A cancelled stream asks for far more tokens than it reads, so the server is still writing
# when the disconnect reaches it (with 12 it could finish first and rightly answer 200).
CANCELLED_TOKENS = 200


def test_disconnects_abort_and_free_every_block(server, client):
    alone = {p: greedy_text(client, p, STREAM_TOKENS) for p in PROMPTS}
    cancel = set(range(0, STREAMS, 4))  # every fourth stream
    before = _http_counts(server).get((C, "POST", "499"), 0)

    async def stream(session, i):
        tokens = CANCELLED_TOKENS if i in cancel else STREAM_TOKENS
        body = {"model": MODEL, "prompt": PROMPTS[i % 4], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        async with session.post(server.url + C, json=body) as response:
            assert response.status == 200
            text, events = "", 0
            async for line in response.content:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                text += json.loads(line[6:])["choices"][0]["text"]
                if i in cancel and events == 2:
                    response.close()  # the client goes away mid-stream
                    return None
            return text

    async def non_stream(session):
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(server.url + C, json=body,
                                    timeout=aiohttp.ClientTimeout(total=1.0)) as response:
                await response.read()

    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            return await asyncio.wait_for(asyncio.gather(
                *(stream(session, i) for i in range(STREAMS)), non_stream(session),
                non_stream(session)), 180)

    results = asyncio.run(run())[:STREAMS]
    for i, text in enumerate(results):
        if i in cancel:
            assert text is None
        else:
            assert text == alone[PROMPTS[i % 4]], i
    free, usable = wait_engine_idle(server)
    assert free == usable  # every KV block is back
    assert not server.state.active and server.state.admission.pending == 0
    # The middleware counts a 499 as its handler unwinds, which may trail the engine's abort.
    deadline = time.monotonic() + 10
    while _http_counts(server).get((C, "POST", "499"), 0) < before + len(cancel) + 2:
        assert time.monotonic() < deadline, _http_counts(server)
        time.sleep(0.05)


# ---------------------------------------------------------------------------- metrics
def test_metrics_parse_and_count_the_requests_sent(server, client):
    label = (("model_name", MODEL),)
    before = metric_samples(server)
    usages = []
    for prompt in PROMPTS[:3]:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
        usages.append(out.usage)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", top_p=7)
    after = metric_samples(server)

    def delta(name, labels=label):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    length = tuple(sorted(label + (("finished_reason", "length"),)))
    assert delta("jaxllm:request_success_total", length) == 3
    assert delta("jaxllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("jaxllm:generation_tokens_total") == 15
    assert delta("jaxllm:e2e_request_latency_seconds_count") == 3
    assert delta("jaxllm:time_to_first_token_seconds_count") == 3
    assert delta("jaxllm:time_per_output_token_seconds_count") >= 3
    http = (("handler", C), ("method", "POST"))
    assert delta("jaxllm:http_requests_total", http + (("status", "200"),)) == 3
    assert delta("jaxllm:http_requests_total", http + (("status", "400"),)) == 1
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "kv_cache_waste_perc", "host_rss_bytes"):
        assert (f"jaxllm:{name}", label) in after, name
    assert after[("jaxllm:kv_cache_usage_perc", label)] == 0
    assert after[("jaxllm:engine_healthy", label)] == 1


def test_request_ids_and_fields_look_like_openais(server):
    _, _, raw = request(server, "POST", C, {"prompt": ["a", "b"], "max_tokens": 2,
                                            "temperature": 0, "echo": True})
    out = json.loads(raw)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", out["id"])
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["choices"][0]["text"].startswith("a") and out["choices"][1]["text"][0] == "b"
    assert out["usage"]["completion_tokens"] == 4
