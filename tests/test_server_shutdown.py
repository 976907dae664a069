"""SIGTERM to a server process under load: new requests and /health get 503, a short request
in flight finishes, a long one is aborted at --shutdown-timeout, and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parent.parent
SHUTDOWN_TIMEOUT = 4.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w+")
    cmd = [sys.executable, "-m", "jaxllm.serve", "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "4",
           "--max-num-batched-tokens", "64", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
           "--disable-log-requests", "--disable-log-stats"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.3)
    try:
        assert proc.poll() is None, log.read()
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        log.close()


def test_sigterm_drains_in_flight_requests_and_exits_0(server_process):
    proc, url, log = server_process

    async def stream(session, max_tokens, started):
        body = {"prompt": "Tell me a story about a dragon.", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        finish, tokens = None, 0
        async with session.post("/v1/completions", json=body) as response:
            assert response.status == 200
            async for line in response.content:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    started.set()
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        finish = chunk["choices"][0]["finish_reason"] or finish
                    else:
                        tokens = chunk["usage"]["completion_tokens"]
        return finish, tokens

    async def scenario():
        async with aiohttp.ClientSession(base_url=url) as session:
            assert (await session.get("/health")).status == 200
            short_started, long_started = asyncio.Event(), asyncio.Event()
            short = asyncio.create_task(stream(session, 16, short_started))
            long = asyncio.create_task(stream(session, 480, long_started))
            await short_started.wait()
            await long_started.wait()
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.3)
            health = (await session.get("/health")).status
            late = await session.post("/v1/completions", json={"prompt": "hi"})
            late_body = await late.json()
            results = await asyncio.gather(short, long)
            return signalled, health, late.status, late_body, results

    signalled, health, late_status, late_body, (short, long) = asyncio.run(
        asyncio.wait_for(scenario(), 120))
    assert health == 503
    assert late_status == 503 and late_body["error"]["type"] == "ServiceUnavailableError"
    assert short == ("length", 16)  # finished in full
    assert long[0] == "abort" and 0 < long[1] < 480  # cut at --shutdown-timeout
    assert proc.wait(SHUTDOWN_TIMEOUT + 20) == 0
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT + 20
    log.seek(0)
    text = log.read()
    assert "aborting 1 requests" in text and "Traceback" not in text
