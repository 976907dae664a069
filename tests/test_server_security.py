"""The security basics of a public endpoint: HTTPS with a self-signed certificate, CORS off
unless origins are named (preflights, errors and streams), the API key never in the logs nor
request content unless --enable-log-requests, and clear errors for TLS/CORS settings that
cannot work. A tiny random model over SmolLM2's
tokenizer behind a live server."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl

import aiohttp
import pytest
from aiohttp import web
from jaxllm.serve.args import ServerConfig, build_parser, configs_from_args
from jaxllm.serve.server import BackgroundServer
from test_engine import make_engine
from test_structured_outputs import tiny_over_smollm2_vocab  # noqa: F401 - a fixture

from jaxllm import AsyncLLMEngine

TLS = os.path.join(os.path.dirname(__file__), "fixtures", "tls")
CERT, KEY = os.path.join(TLS, "localhost.crt"), os.path.join(TLS, "localhost.key")
ORIGIN = "https://app.example.com"
KEY_TEXT = "s3cret-key-never-logged"
C = "/v1/completions"
BODY = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}


def serve(model, **config):
    engine = AsyncLLMEngine(make_engine(model, max_model_len=64))
    return BackgroundServer(engine, ServerConfig(host="127.0.0.1", port=0,
                                                 disable_log_stats=True, **config))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_https_with_a_self_signed_certificate(tiny_over_smollm2_vocab):  # noqa: F811
    trusted = ssl.create_default_context(cafile=CERT)
    with serve(tiny_over_smollm2_vocab, ssl_certfile=CERT, ssl_keyfile=KEY) as server:
        assert server.url.startswith("https://")

        async def scenario():
            async with aiohttp.ClientSession(base_url=server.url) as session:
                health = await session.get("/health", ssl=trusted)
                done = await session.post(C, json=BODY, ssl=trusted)
                body = await done.json()
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await session.get("/health")  # the default trust store: not trusted
            plain = server.url.replace("https://", "http://")
            async with aiohttp.ClientSession(base_url=plain) as session:
                with pytest.raises(aiohttp.ClientError):
                    await session.get("/health")  # no plain HTTP on the TLS port
            return health.status, done.status, body

        health, status, body = run(scenario())
    assert health == 200 and status == 200
    assert body["usage"]["completion_tokens"] == 3


def test_cors_is_off_by_default_and_follows_allowed_origins(tiny_over_smollm2_vocab,  # noqa: F811
                                                            caplog):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    auth = {"Authorization": f"Bearer {KEY_TEXT}", "Origin": ORIGIN}

    async def calls(server):
        async with aiohttp.ClientSession(base_url=server.url) as session:
            pre = await session.options(C, headers=preflight)
            other = await session.options(C, headers=preflight | {"Origin": "https://evil.example"})
            wrong_key = await session.post(C, json=BODY, headers=auth | {
                "Authorization": "Bearer wrong"})
            stream = await session.post(C, json=BODY | {"stream": True}, headers=auth)
            text = await stream.text()
            foreign = await session.post(C, json=BODY, headers=auth | {
                "Origin": "https://evil.example"})
            return pre, other, wrong_key, stream, text, foreign

    caplog.set_level(logging.DEBUG)
    with serve(tiny_over_smollm2_vocab, api_key=KEY_TEXT) as server:
        off = run(calls(server))
    assert "POST /v1/completions" in caplog.text  # the access log did run
    assert BODY["prompt"] not in caplog.text  # no request content without the flag
    caplog.clear()
    with serve(tiny_over_smollm2_vocab, api_key=KEY_TEXT, allowed_origins=(ORIGIN,),
               enable_log_requests=True, max_log_len=3) as server:
        on = run(calls(server))
    assert "prompt: 'Hel'" in caplog.text  # asked for, and cut to --max-log-len

    allow = "Access-Control-Allow-Origin"
    pre, other, wrong_key, stream, text, foreign = off
    assert pre.status == 405 and other.status == 405  # no CORS: no preflight answers
    assert all(allow not in r.headers for r in off if isinstance(r, aiohttp.ClientResponse))
    assert wrong_key.status == 401 and stream.status == 200 and text.endswith("[DONE]\n\n")

    pre, other, wrong_key, stream, text, foreign = on
    assert pre.status == 204 and pre.headers[allow] == ORIGIN
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert other.status == 403 and allow not in other.headers
    assert wrong_key.status == 401 and wrong_key.headers[allow] == ORIGIN  # readable error
    assert stream.status == 200 and stream.headers[allow] == ORIGIN
    assert text.endswith("data: [DONE]\n\n")
    assert foreign.status == 200 and allow not in foreign.headers  # the browser refuses it
    assert KEY_TEXT not in caplog.text  # neither the access log nor the start-up line


def test_a_body_sent_too_slowly_gets_408_and_the_connection_closes(
        tiny_over_smollm2_vocab):  # noqa: F811
    with serve(tiny_over_smollm2_vocab, request_body_timeout=0.5) as server:
        host, port = server.url.removeprefix("http://").split(":")

        async def slowloris():
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
            await writer.drain()  # ... and the other 90 bytes never come
            answer = await reader.read()  # until the server closes the connection
            writer.close()
            return answer

        started = asyncio.run(asyncio.wait_for(slowloris(), 30))
        healthy = run(_get(server.url + "/health"))
    assert started.startswith(b"HTTP/1.1 408")
    assert b'"type": "RequestTimeoutError"' in started and b"--request-body-timeout" in started
    assert healthy == 200


async def _get(url: str) -> int:
    async with aiohttp.ClientSession() as session:
        return (await session.get(url)).status


@pytest.mark.parametrize("flags, message", [
    (["--ssl-keyfile", KEY], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", KEY, "--ssl-certfile", "/no/such.crt"], "--ssl-certfile='/no/such.crt'"),
    (["--ssl-cert-reqs", "2"], "need --ssl-keyfile"),
    (["--ssl-keyfile", KEY, "--ssl-certfile", CERT, "--ssl-cert-reqs", "2"],
     "give --ssl-ca-certs"),
    (["--ssl-keyfile", KEY, "--ssl-certfile", os.path.join(TLS, "make_cert.sh")],
     "cannot load"),
])
def test_tls_settings_that_cannot_work_are_refused_before_loading(flags, message):
    args = build_parser().parse_args(flags)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        configs_from_args(args, environ={})


def test_allowed_origins_is_a_json_list(capsys):
    args = build_parser().parse_args(["--allowed-origins", '["https://a.example", "*"]'])
    assert configs_from_args(args, environ={})[1].allowed_origins == ("https://a.example", "*")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--allowed-origins", "https://a.example"])
    assert "JSON list" in capsys.readouterr().err


@pytest.mark.parametrize("constraint", [{"regex": "a" * (64 * 1024 + 1)},
                                        {"choice": ["x" * 1024] * 65},
                                        {"json": {"enum": ["y" * 1024] * 70}}])
def test_a_constraint_past_its_size_limit_is_refused(constraint):
    from jaxllm.serve.errors import APIError
    from jaxllm.serve.protocol import parse_completion

    parse_completion({"prompt": "hi", "structured_outputs": {"regex": "a+"}}, vocab_size=100,
                     max_n=4)
    with pytest.raises(APIError) as refused:
        parse_completion({"prompt": "hi", "structured_outputs": constraint}, vocab_size=100,
                         max_n=4)
    assert refused.value.status == 400 and "limit of 65536" in refused.value.message


def test_a_client_that_stops_reading_its_stream_is_dropped_and_its_request_aborted():
    """A stream whose client takes nothing for the stall timeout counts as gone: the handler
    returns, and closing its outputs is what aborts the engine request."""
    import contextlib
    import types
    from unittest import mock

    from aiohttp.test_utils import make_mocked_request
    from jaxllm.serve.generation import STATE, STATUS, _stream
    from jaxllm.serve.protocol import GenerationRequest
    from jaxllm.serve.responses import ResponseBuilder

    from jaxllm import SamplingParams
    from jaxllm.engine.outputs import CompletionOutput, RequestOutput

    writes = []

    async def write(data, *args, **kwargs):
        if writes:  # the client read the first write, then stopped reading
            await asyncio.Event().wait()
        writes.append(data)

    writer = mock.Mock(write=write, write_headers=mock.AsyncMock(),
                       write_eof=mock.AsyncMock(), drain=mock.AsyncMock())
    app = web.Application()
    app[STATE] = types.SimpleNamespace(config=ServerConfig(stream_stall_timeout=0.2))
    request = make_mocked_request("POST", C, app=app, writer=writer)
    closed = []

    async def outputs():
        try:
            for step in range(10_000):
                await asyncio.sleep(0)
                yield 0, RequestOutput("r", "hi", [1], [CompletionOutput(
                    0, f"t{step}", [step], None, None)], False, metrics=None)
        finally:
            closed.append(True)  # the engine request is aborted here

    req = GenerationRequest(chat=False, model=None, params=SamplingParams(), stream=True)
    builder = ResponseBuilder(req, "id", "m", [1], ["hi"], str)

    async def scenario():
        async with contextlib.aclosing(outputs()) as stream:
            return await asyncio.wait_for(_stream(request, builder, stream), 10)

    run(scenario())
    assert request[STATUS] == 499 and len(writes) == 1 and closed == [True]
