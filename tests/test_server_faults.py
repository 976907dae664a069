"""A failing engine step, injected into a live server: the requests in flight get a 500 (in
the status line, or in-band once a stream has started), then the server stops with exit
status 1 (vLLM's behaviour), or, kept alive, /health and /live turn 503 and new requests get
503; nothing hangs."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from conftest import SMOLLM2_ENGINE_ARGS
from jaxllm.serve.args import ServerConfig
from jaxllm.serve.server import BackgroundServer
from test_engine import make_engine
from test_structured_outputs import tiny_over_smollm2_vocab  # noqa: F401 - a fixture

from jaxllm import AsyncLLMEngine, EngineConfig, LLMEngine

pytestmark = pytest.mark.slow
C = "/v1/completions"


@pytest.fixture(scope="module")
def faulty(smollm2):
    # Its own engine (the fault kills it), with the shared engine's limits: the step shapes
    # it runs come from the run's compilation cache.
    engine = LLMEngine(EngineConfig(**SMOLLM2_ENGINE_ARGS), model=smollm2, progress=False)
    fault = {"armed": False}
    real_step = engine.step

    def step():
        if fault["armed"]:
            raise RuntimeError("injected device fault")
        return real_step()

    engine.step = step  # the async engine's loop calls engine.step()
    config = ServerConfig(host="127.0.0.1", port=0, disable_log_requests=True,
                          disable_log_stats=True, keep_alive_on_engine_death=True)
    with BackgroundServer(AsyncLLMEngine(engine), config) as server:
        yield server, fault


def test_a_failing_step_fails_requests_in_flight_and_turns_health_503(faulty):
    server, fault = faulty
    long = {"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0}

    async def scenario():
        async with aiohttp.ClientSession(base_url=server.url) as session:
            assert (await session.get("/health")).status == 200
            stream = await session.post(C, json=long | {"stream": True})
            assert stream.status == 200
            first = await stream.content.readline()
            assert first.startswith(b"data: {")
            blocking = asyncio.create_task(session.post(C, json=long))
            while server.state.admission.pending or len(server.state.active) < 2:
                await asyncio.sleep(0.01)  # both requests are in the engine
            fault["armed"] = True
            rest = (await stream.content.read()).decode()
            response = await blocking
            return rest, response.status, await response.json()

    started = time.monotonic()
    rest, status, body = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert time.monotonic() - started < 30
    events = [e for e in rest.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    assert "injected device fault" in error["message"]
    assert status == 500 and body["error"]["type"] == "InternalServerError"

    async def after():
        async with aiohttp.ClientSession(base_url=server.url) as session:
            health = (await session.get("/health")).status
            live = (await session.get("/live")).status
            late = await session.post(C, json={"prompt": "hi", "max_tokens": 2})
            metrics = await (await session.get("/metrics")).text()
            return health, live, late.status, await late.json(), metrics

    health, live, late_status, late, metrics = asyncio.run(asyncio.wait_for(after(), 30))
    assert health == 503 and live == 503
    assert late_status == 503 and late["error"]["type"] == "ServiceUnavailableError"
    assert 'jaxllm:engine_healthy{model_name="SmolLM2-135M-Instruct"} 0.0' in metrics
    assert not server.state.active and server.state.handlers == 0


def test_the_server_exits_1_when_the_engine_dies(tiny_over_smollm2_vocab):  # noqa: F811
    engine = make_engine(tiny_over_smollm2_vocab, max_model_len=64)
    real_step = engine.step
    fault = {"armed": False}

    def step():
        if fault["armed"]:
            raise RuntimeError("injected device fault")
        return real_step()

    engine.step = step
    config = ServerConfig(host="127.0.0.1", port=0, disable_log_requests=True,
                          disable_log_stats=True)
    server = BackgroundServer(AsyncLLMEngine(engine), config).start()
    try:
        async def scenario():
            async with aiohttp.ClientSession(base_url=server.url) as session:
                ok = await session.post(C, json={"prompt": "hi", "max_tokens": 2})
                fault["armed"] = True
                failed = await session.post(C, json={"prompt": "hi", "max_tokens": 2})
                return ok.status, failed.status, await failed.json()

        ok, status, body = asyncio.run(asyncio.wait_for(scenario(), 60))
        exit_status = server.wait(30)  # it stops by itself
    finally:
        server.stop()
    assert ok == 200 and status == 500 and "injected device fault" in body["error"]["message"]
    assert exit_status == 1
