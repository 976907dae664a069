"""The engine core in its own process (jaxllm serve's default) and ``--api-server-count``
front ends: the same tokens as the engine in-process, refusals and aborts across the process
boundary, and every death detected within bounded time, whichever side dies (never a hang,
never an orphaned process)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
from conftest import SMOLLM2_ENGINE_ARGS, assert_engine_idle
from jaxllm.serve.args import ServerConfig
from jaxllm.serve.server import BackgroundServer
from prometheus_client.parser import text_string_to_metric_families
from test_server_shutdown import ROOT, free_port, healthy

from jaxllm import EngineConfig, SamplingParams
from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.core_process import EngineStartError, launch_engine_core

pytestmark = pytest.mark.slow
C = "/v1/completions"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
ENGINE = EngineConfig(dtype="float32", **SMOLLM2_ENGINE_ARGS)
SERVER = ServerConfig(host="127.0.0.1", port=0, disable_log_requests=True,
                      disable_log_stats=True)


@pytest.fixture(scope="module")
def core_server():
    handle = launch_engine_core(ENGINE)
    with BackgroundServer(EngineCoreClient.for_handle(handle), SERVER) as server:
        yield server, handle
    assert not handle.process.is_alive() and handle.process.exitcode == 0


def snapshot(server):
    return server.call(server.engine.snapshot)


def wait_idle(server, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        s = snapshot(server)
        if not (s.running or s.waiting or s.swapped) and s.kv_usage == 0:
            return s
        assert time.monotonic() < deadline, f"the core is not idle: {s}"
        time.sleep(0.05)


async def stream_text(session, body) -> tuple[str, str | None]:
    text, finish = "", None
    async with session.post(C, json=body | {"stream": True}) as response:
        assert response.status == 200
        async for line in response.content:
            line = line.decode().strip()
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish


def test_the_core_process_serves_the_in_process_engines_tokens(core_server, smollm2_llm):
    server, _ = core_server
    expected = [o.outputs[0].text for o in smollm2_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12))]
    assert_engine_idle(smollm2_llm.engine)

    async def scenario():
        async with aiohttp.ClientSession(base_url=server.url) as session:
            bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in PROMPTS]
            responses = await asyncio.gather(*(session.post(C, json=b) for b in bodies))
            texts = [(await r.json())["choices"][0]["text"] for r in responses]
            streamed = await asyncio.gather(*(stream_text(session, b) for b in bodies))
            return texts, streamed

    texts, streamed = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert texts == expected
    assert [t for t, _ in streamed] == expected and {f for _, f in streamed} == {"length"}
    wait_idle(server)


async def stream_choice(session, body) -> dict:
    """A streamed completion put back together: text, finish and stop reasons, usage."""
    got = {"text": "", "finish_reason": None, "stop_reason": None, "usage": None}
    async with session.post(C, json=body | {"stream": True,
                                            "stream_options": {"include_usage": True}}) as r:
        assert r.status == 200
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            got["usage"] = chunk.get("usage") or got["usage"]
            for choice in chunk["choices"]:
                got["text"] += choice["text"]
                if choice["finish_reason"]:
                    got["finish_reason"] = choice["finish_reason"]
                    got["stop_reason"] = choice.get("stop_reason")
    return got


def test_stop_strings_end_requests_in_the_front_end_and_in_the_core(core_server, smollm2_llm):
    # The core ships token ids; the front end detokenizes and finds the stop strings. The
    # text, finish and stop reasons and usage are the in-process engine's, streamed or not,
    # and the core stops each request there: it generates a step or two past the stop, not
    # up to max_tokens, and frees its blocks.
    server, _ = core_server
    free = smollm2_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    words = [o.outputs[0].text.split() for o in free]
    stops = [w[len(w) // 2] for w in words]  # a word from the middle of each greedy text
    include = [False, True, False]  # include_stop_str_in_output
    params = [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=[s],
                             include_stop_str_in_output=i)
              for s, i in zip(stops, include, strict=True)]
    expected = [o.outputs[0] for o in smollm2_llm.generate(PROMPTS, params)]
    assert {o.finish_reason for o in expected} == {"stop"}
    while smollm2_llm.engine.has_unfinished_requests():  # a step still in flight
        smollm2_llm.engine.step()
    assert_engine_idle(smollm2_llm.engine)
    before = wait_idle(server).generation_tokens

    async def finished_as_stop(session) -> float:  # the front end's Prometheus counter
        async with session.get("/metrics") as r:
            families = text_string_to_metric_families(await r.text())
            return sum(s.value for f in families for s in f.samples
                       if s.name == "jaxllm:request_success_total"
                       and s.labels["finished_reason"] == "stop")

    async def scenario():
        async with aiohttp.ClientSession(base_url=server.url) as session:
            counted = await finished_as_stop(session)
            bodies = [{"prompt": p, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                       "stop": [s], "include_stop_str_in_output": i}
                      for p, s, i in zip(PROMPTS, stops, include, strict=True)]
            responses = await asyncio.gather(*(session.post(C, json=b) for b in bodies))
            whole = [await r.json() for r in responses]
            streamed = await asyncio.gather(*(stream_choice(session, b) for b in bodies))
            return whole, streamed, await finished_as_stop(session) - counted

    whole, streamed, counted = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert counted == 2 * len(PROMPTS)
    for out, body, got in zip(expected, whole, streamed, strict=True):
        want = {"text": out.text, "finish_reason": "stop", "stop_reason": out.stop_reason,
                "completion_tokens": len(out.token_ids)}
        choice = body["choices"][0]
        assert {k: choice[k] for k in ("text", "finish_reason", "stop_reason")} | {
            "completion_tokens": body["usage"]["completion_tokens"]} == want
        assert {k: got[k] for k in ("text", "finish_reason", "stop_reason")} | {
            "completion_tokens": got["usage"]["completion_tokens"]} == want
    idle = wait_idle(server)
    # The core learns of a stop string only when the front end's abort arrives, so how far
    # it runs past the stop depends on the front end's latency (a few steps here, more on a
    # loaded CI machine): the bound is that the requests ended far short of max_tokens,
    # under half of the 2 x 3 x 200 tokens that running to max_tokens would generate.
    generated = idle.generation_tokens - before
    assert 2 * sum(len(o.token_ids) for o in expected) <= generated < len(PROMPTS) * 200
    assert idle.kv_usage == 0 and idle.num_free_blocks == idle.num_gpu_blocks - 1


def test_refusals_cross_the_process_boundary_as_400s(core_server):
    server, _ = core_server

    async def scenario():
        async with aiohttp.ClientSession(base_url=server.url) as session:
            # Refused by the core's add_request (the front end does not check priorities).
            priority = await session.post(C, json={"prompt": "hi", "max_tokens": 2,
                                                   "priority": 3})
            # Refused by the front end's own grammar compiler, before the core sees it.
            schema = await session.post(C, json={
                "prompt": "hi", "max_tokens": 2,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "object", "minProperties": "two"}}}})
            return (priority.status, await priority.json(), schema.status,
                    await schema.json())

    p_status, p_body, s_status, s_body = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert p_status == 400 and "scheduling-policy priority" in p_body["error"]["message"]
    assert s_status == 400 and s_body["error"]["type"] == "BadRequestError"
    wait_idle(server)


def test_a_client_that_goes_away_frees_its_blocks_in_the_core(core_server):
    server, _ = core_server

    async def scenario():
        async with aiohttp.ClientSession(base_url=server.url) as session:
            response = await session.post(C, json={"prompt": "Tell me a story.",
                                                   "max_tokens": 200, "ignore_eos": True,
                                                   "temperature": 0, "stream": True})
            assert response.status == 200
            await response.content.readline()  # decoding has started
            running = snapshot_in_loop()
            response.close()  # the client goes away mid-stream
            return await running

    def snapshot_in_loop():
        return asyncio.get_running_loop().run_in_executor(None, snapshot, server)

    busy = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert busy.running == 1 and busy.kv_usage > 0
    idle = wait_idle(server)
    assert idle.num_free_blocks == idle.num_gpu_blocks - 1


def test_a_killed_core_fails_requests_in_flight_and_the_server_exits_1():
    handle = launch_engine_core(ENGINE)
    server = BackgroundServer(EngineCoreClient.for_handle(handle), SERVER).start()
    try:
        async def scenario():
            async with aiohttp.ClientSession(base_url=server.url) as session:
                response = await session.post(C, json={
                    "prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True,
                    "stream": True})
                await response.content.readline()
                killed = time.monotonic()
                os.kill(handle.process.pid, signal.SIGKILL)
                rest = (await response.content.read()).decode()
                return rest, time.monotonic() - killed

        rest, seconds = asyncio.run(asyncio.wait_for(scenario(), 60))
        exit_status = server.wait(30)
    finally:
        server.stop()
    events = [e.strip() for e in rest.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]", rest
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and "engine-core process exited" in error["message"]
    assert seconds < 5, f"the stream took {seconds:.1f} s to fail after the kill"
    assert exit_status == 1


def test_a_core_that_cannot_start_says_why():
    impossible = EngineConfig(**(SMOLLM2_ENGINE_ARGS | {"num_gpu_blocks_override": 1 << 40}))
    with pytest.raises(EngineStartError, match="out of memory while allocating the KV cache"):
        launch_engine_core(impossible)


def serve_command(port: int, *extra: str) -> list[str]:
    a = SMOLLM2_ENGINE_ARGS
    return [sys.executable, "-m", "jaxllm.serve", "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--dtype", "float32", "--max-model-len", str(a["max_model_len"]),
            "--max-num-seqs", str(a["max_num_seqs"]),
            "--max-num-batched-tokens", str(a["max_num_batched_tokens"]),
            "--num-gpu-blocks-override", str(a["num_gpu_blocks_override"]),
            "--disable-log-stats", *extra]


def pids_in(log: str) -> tuple[list[int], int]:
    match = re.search(r"front-end processes \(pids ([\d, ]+)\) and the engine-core process "
                      r"\(pid (\d+)\)", log)
    assert match, log
    return [int(p) for p in match.group(1).split(", ")], int(match.group(2))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (not reaped yet) has exited
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def two_front_ends(tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(serve_command(port, "--api-server-count", "2"), cwd=ROOT,
                                env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            assert healthy(url, proc, timeout=300), log_path.read_text()
            deadline = time.monotonic() + 120  # the second front end may start later
            while log_path.read_text().count("serving SmolLM2") < 2:
                assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
                time.sleep(0.2)
            yield proc, url, log_path
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def test_two_front_ends_serve_count_together_and_drain_on_ctrl_c(two_front_ends):
    """SIGINT under load, to the whole process group as Ctrl-C sends it (GNU timeout sends
    SIGTERM the same way): counted once, by the launcher, it kills neither the front ends
    mid-drain nor the core. (SIGTERM to the server alone: tests/test_server_shutdown.py.)"""
    proc, url, log_path = two_front_ends
    front_ends, core = pids_in(log_path.read_text())

    async def scenario():
        async with aiohttp.ClientSession(base_url=url) as session:
            bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in PROMPTS * 4]
            first = await asyncio.gather(*(session.post(C, json=b) for b in bodies))
            statuses = [r.status for r in first]
            metrics = await (await session.get("/metrics")).text()
            # Requests in flight when the launcher is told to stop: each finishes.
            late = [asyncio.create_task(stream_text(session, b)) for b in bodies[:4]]
            await asyncio.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)
            finished = await asyncio.gather(*late)
            return statuses, metrics, finished

    statuses, metrics, finished = asyncio.run(asyncio.wait_for(scenario(), 180))
    assert proc.wait(120) == 0, log_path.read_text()
    log = log_path.read_text()
    assert statuses == [200] * 12
    assert [f for _, f in finished] == ["length"] * 4
    served_by = {i: log.count(f"[api server {i}]: 127.0.0.1") for i in (0, 1)}
    assert sum(served_by.values()) >= 12, log
    assert not any(alive(pid) for pid in [*front_ends, core]), log
    # Either front end's /metrics counts both front ends' requests.
    assert ('jaxllm:http_requests_total{handler="/v1/completions",method="POST",status="200"} '
            '12.0') in metrics, metrics


def test_a_dead_front_end_stops_the_server_with_status_1(two_front_ends):
    proc, url, log_path = two_front_ends
    front_ends, core = pids_in(log_path.read_text())
    with urllib_open(url + "/metrics") as response:
        metrics = response.read().decode()
    assert 'jaxllm:engine_healthy{model_name="SmolLM2-135M-Instruct"} 1.0' in metrics
    killed = time.monotonic()
    os.kill(front_ends[1], signal.SIGKILL)
    assert proc.wait(60) == 1, log_path.read_text()
    assert time.monotonic() - killed < 30
    assert not any(alive(pid) for pid in [*front_ends, core]), log_path.read_text()


def urllib_open(url: str):
    import urllib.request

    return urllib.request.urlopen(url, timeout=10)
