"""Running the app: bind, serve until told to stop, then drain.

Shutdown (SIGTERM / SIGINT, or ``BackgroundServer.stop``): new requests get 503 and
``/health`` turns 503 while the socket stays open; in-flight requests may finish for up to
``--shutdown-timeout`` seconds; what is left is aborted (``finish_reason="abort"``); then the
listener closes and the engine loop stops. A second signal aborts at once.

When the engine dies (a failing step: its requests in flight get a 500), the server does the
same and exits 1, as vLLM does, for the orchestrator to restart it;
``JAXLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1`` keeps it up instead, answering 503 on ``/health``,
``/live`` and new requests.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Callable

from aiohttp import web
from jaxllm.serve.app import build_app, log_config
from jaxllm.serve.args import KEEP_ALIVE_ENV, ServerConfig
from jaxllm.serve.generation import STATE
from jaxllm.serve.security import ssl_context
from jaxllm.serve.state import ServerState

from jaxllm.engine import gc_watch
from jaxllm.engine.engine_client import EngineClient

logger = logging.getLogger("serve")
ABORT_GRACE = 5.0  # seconds for aborted requests to send their last chunk
ENGINE_WATCH_INTERVAL = 0.1  # seconds between checks that the engine loop is alive


async def run_server(engine: EngineClient, config: ServerConfig, stop: asyncio.Event,
                     on_ready: Callable[[web.Application, list], None] | None = None,
                     sock: socket.socket | None = None) -> int:
    """Serves ``engine`` until ``stop`` is set, then drains (see the module docstring).
    ``sock``: a listening socket to serve on (shared by several front-end processes) instead
    of binding ``config``'s host and port. Returns the exit status: 0, or 1 when it stopped
    because the engine died."""
    await engine.attach()
    app = build_app(engine, config)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=ABORT_GRACE,
                           access_log=None if config.disable_log_requests else
                           logging.getLogger("aiohttp.access"))
    await runner.setup()
    watcher = None if config.keep_alive_on_engine_death else asyncio.create_task(
        _stop_when_dead(engine, stop))
    try:
        tls = ssl_context(config.ssl_keyfile, config.ssl_certfile, config.ssl_ca_certs,
                          config.ssl_cert_reqs)
        site = (web.SockSite(runner, sock, ssl_context=tls) if sock is not None else
                web.TCPSite(runner, config.host, config.port, ssl_context=tls))
        await site.start()
        state = app[STATE]
        scheme = "https" if tls is not None else "http"
        logger.info("serving %s on %s (%s)", state.model_name,
                    ", ".join(f"{scheme}://{a[0]}:{a[1]}" for a in runner.addresses),
                    log_config(config))
        if on_ready is not None:
            on_ready(app, runner.addresses)
        await stop.wait()
        await drain(state, config.shutdown_timeout)
    finally:
        if watcher is not None:
            watcher.cancel()
        await runner.cleanup()
    return 1 if engine.dead_error is not None and watcher is not None else 0


async def _stop_when_dead(engine: EngineClient, stop: asyncio.Event) -> None:
    """As vLLM: once the engine has died (its requests in flight got their 500s), the server
    stops and exits non-zero, for the orchestrator to restart it."""
    while engine.dead_error is None:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL)
    logger.error("the engine died (%r): stopping, exit status 1 (%s=1 keeps the server up "
                 "with /health answering 503)", engine.dead_error, KEEP_ALIVE_ENV)
    stop.set()


async def drain(state: ServerState, timeout: float) -> None:
    state.draining = True
    if state.handlers:
        logger.info("shutting down: %d requests in flight get up to %.0f s to finish",
                    state.handlers, timeout)
    if not await state.wait_idle(timeout):
        # NOTE: counted on the engine thread, not len(state.active): a request that finished
        # in the engine just before the deadline is still in `active` until its handler reads
        # the final output, and it is neither aborted nor reported as aborted.
        logger.warning("shutdown timeout: aborting %d requests", await state.abort_unfinished())
        await state.wait_idle(ABORT_GRACE)
    logger.info("drained; stopping")


def serve_forever(engine: EngineClient, config: ServerConfig,
                  sock: socket.socket | None = None,
                  stop_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> int:
    """Blocks until SIGTERM/SIGINT (or the engine's death) and the drain that follows; stops
    the engine loop; returns the exit status (``run_server``'s)."""

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        states: list[ServerState] = []

        def on_signal() -> None:
            if stop.is_set():  # second signal: stop waiting for in-flight requests
                for state in states:
                    state.abort_all()
            stop.set()

        for sig in stop_signals:
            loop.add_signal_handler(sig, on_signal)
        return await run_server(engine, config, stop,
                                lambda app, _: states.append(app[STATE]), sock)

    # A serving process's start-up heap (the tokenizer, the app, jax's and aiohttp's modules)
    # leaves the collector's generations: a full collection then walks only what requests
    # allocate. Unfrozen, gen-2 collections of an API server took 334-734 ms in the CI's test
    # processes (gc_watch's warnings); a ~200 ms stall of that size, not yet attributed, set
    # the H200's 10 req/s P99 TTFT (benchmarks/RESULTS.md, 2026-12-03). Here only: this
    # function owns its process, unlike BackgroundServer in a test or notebook.
    gc_watch.settle(logger, "api server")
    engine.start()
    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


class BackgroundServer:
    """The server on its own thread and event loop, for tests and notebooks::

        with BackgroundServer(AsyncLLMEngine(llm.engine), ServerConfig(port=0)) as server:
            requests.get(server.url + "/health")
    """

    def __init__(self, engine: EngineClient, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.app: web.Application | None = None
        self.url = ""
        self.exit_status: int | None = None  # run_server's, once it has returned
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jaxllm-server", daemon=True)

    @property
    def state(self) -> ServerState:
        assert self.app is not None
        return self.app[STATE]

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.engine.start()
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"the server did not start: {self._error!r}")
        return self

    def stop(self, timeout: float = 60.0) -> None:
        if self._loop is not None and self._stop is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # its loop has ended already (it stopped by itself)
                pass
        self._thread.join(timeout)
        self.engine.shutdown()

    def wait(self, timeout: float) -> int | None:
        """Waits for the server to stop by itself (the engine died); its exit status, or None
        if it is still serving after ``timeout`` seconds."""
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self.exit_status

    def call(self, fn: Callable, timeout: float = 60.0):
        """Runs ``await fn()`` on the server's loop (e.g. ``engine.run_in_engine(...)``) and
        returns its result."""
        assert self._loop is not None

        async def run():
            return await fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.exit_status = await run_server(self.engine, self.config, self._stop,
                                                self._on_ready)

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._ready.set()

    def _on_ready(self, app: web.Application, addresses: list) -> None:
        self.app = app
        host, port = addresses[0][:2]
        scheme = "https" if self.config.ssl_certfile else "http"
        self.url = f"{scheme}://{host}:{port}"
        self._ready.set()
