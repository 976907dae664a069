"""The live OpenAI-compatible server the server tests share: SmolLM2 on CPU on 127.0.0.1,
over the run's shared engine (conftest's module-scoped ``server`` and ``client`` fixtures),
with raw-HTTP and metrics helpers."""

from __future__ import annotations

import http.client
import json
import time

import openai
from conftest import assert_engine_idle
from jaxllm.serve.args import ServerConfig
from jaxllm.serve.server import BackgroundServer
from prometheus_client.parser import text_string_to_metric_families

from jaxllm import AsyncLLMEngine

KEY = "test-key"
MODEL = "smollm2"
MAX_MODEL_LEN = 256
BODY_LIMIT = 64 * 1024
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "The three primary colors are"]
C, CHAT = "/v1/completions", "/v1/chat/completions"


def serve_smollm2(smollm2_llm):
    """A server over the run's shared SmolLM2 engine (conftest), left idle afterwards: the
    body of conftest's ``server`` fixture."""
    engine = smollm2_llm.engine
    assert engine.config.max_model_len == MAX_MODEL_LEN
    config = ServerConfig(host="127.0.0.1", port=0, served_model_name=(MODEL, "alias"),
                          api_key=KEY, max_request_body_bytes=BODY_LIMIT,
                          disable_log_requests=True, stats_interval=1.0, memory_monitor=True,
                          memory_monitor_interval=0.5)
    with BackgroundServer(AsyncLLMEngine(engine), config) as s:
        yield s
    assert_engine_idle(engine)


def openai_client(server) -> openai.OpenAI:
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


def http_counts(server) -> dict:
    """The server's own count of answers: (handler, method, status) -> requests."""
    out = {}
    for (name, labels), value in metric_samples(server).items():
        if name == "jaxllm:http_requests_total":
            d = dict(labels)
            out[(d["handler"], d["method"], d["status"])] = value
    return out
