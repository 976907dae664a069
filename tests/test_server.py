"""The OpenAI-compatible server against a live in-process instance on 127.0.0.1 (SmolLM2 on
CPU, tests/server_harness.py): the official ``openai`` client, SSE framing, overload (429),
client disconnects (aborts free every KV block), metrics and auth. Bad inputs:
test_server_inputs.py."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import openai
import pytest
from server_harness import (
    KEY,
    MODEL,
    PROMPTS,
    C,
    greedy_text,
    http_counts,
    metric_samples,
    request,
    wait_engine_idle,
)

pytestmark = pytest.mark.slow


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
    before = http_counts(server).get((C, "POST", "499"), 0)

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
    while http_counts(server).get((C, "POST", "499"), 0) < before + len(cancel) + 2:
        assert time.monotonic() < deadline, http_counts(server)
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
