"""``--api-server-count N`` > 1: N HTTP front-end processes on one listening socket, in front of
the engine-core processes (one, or one per ``--data-parallel-size`` replica), and this
launcher watching them all.

The launcher binds the port once and hands the socket to each front end (spawned; the kernel
spreads new connections over the processes accepting on it). Each front end is a whole server
(:func:`~jaxllm.serve.server.serve_forever`) over an
:class:`~jaxllm.engine.core_client.EngineCoreClient` with its own routing id and a connection
and lifeline to every core (each front end balances its own requests over the replicas).
Prometheus counters and histograms are summed over the front ends (prometheus_client's
multiprocess mode, in a private directory), so any front end's ``/metrics`` reports the
server's totals.

Signals: SIGTERM or SIGINT to the launcher is passed to every front end as SIGUSR1, on which
it drains as one server does on SIGTERM; a second one is passed on too (abort what is left).
The front ends ignore SIGTERM and SIGINT themselves, so a signal sent to the whole process
group (Ctrl-C, GNU timeout) is counted once, by the launcher, and never kills a front end in
the middle of its drain. When every front end has
exited the launcher stops the cores. A front end or a core dying by itself is a failure:
the others are told to drain and stop, and the launcher exits 1 for the orchestrator.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from typing import Any

from jaxllm.serve.args import ServerConfig

from jaxllm.engine.core_process import EngineCoreHandle
from jaxllm.engine.engine_client import EngineInfo

logger = logging.getLogger("serve")
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
WATCH_INTERVAL = 0.2  # seconds between the launcher's checks of its signals
DRAIN_SIGNAL = signal.SIGUSR1  # launcher -> front end: drain (a second one: abort the rest)


def bind(config: ServerConfig) -> socket.socket:
    """The one listening socket of every front end (IPv4 and IPv6 on every interface when no
    host is given, as a single server binds)."""
    host = config.host
    if host is None or host == "":
        sock = socket.create_server(("", config.port), family=socket.AF_INET6, dualstack_ipv6=True,
                                    backlog=1024, reuse_port=False) \
            if socket.has_dualstack_ipv6() else socket.create_server(("", config.port),
                                                                     backlog=1024)
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, config.port), family=family, backlog=1024)
    sock.set_inheritable(True)
    return sock


def run_front_ends(handles: list[EngineCoreHandle], config: ServerConfig) -> int:
    """Serves until signalled (or until a process dies), then drains; the exit status."""
    count = config.api_server_count
    metrics_dir = tempfile.mkdtemp(prefix="jaxllm-metrics-")
    os.environ[PROMETHEUS_DIR_ENV] = metrics_dir  # read by the front ends' prometheus_client
    try:
        sock = bind(config)
    except OSError as e:
        _stop_cores(handles)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        print(f"jaxllm serve: error: {e}")
        return 1
    ctx = multiprocessing.get_context("spawn")
    front_ends = [ctx.Process(target=front_end_main, name=f"jaxllm-api-server-{i}",
                              args=(i, [h.address for h in handles], handles[0].info,
                                    handles[0].tokenizer, [h.lifelines[i] for h in handles],
                                    config, sock, logging.getLogger().level))
                  for i in range(count)]
    for process in front_ends:
        process.start()
    for handle in handles:
        for conn in handle.lifelines:  # each front end holds its own end now
            conn.close()
        handle.lifelines = []
    sock.close()
    host, port = config.host or "0.0.0.0", config.port
    cores = ", ".join(str(h.process.pid) for h in handles)
    logger.info("serving on %s:%d from %d front-end processes (pids %s) and the engine-core "
                "process%s (pid%s %s)", host, port, count,
                ", ".join(str(p.pid) for p in front_ends), *(("es", "s") if len(handles) > 1
                                                             else ("", "")), cores)
    try:
        failed = _watch(front_ends, handles)
    finally:
        for process in front_ends:
            process.join(config.shutdown_timeout + 30)
            if process.is_alive():
                process.kill()
        codes = _stop_cores(handles)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    statuses = [p.exitcode for p in front_ends]
    logger.info("front ends exited with %s; engine cores with %s", statuses, codes)
    return 1 if failed or any(s != 0 for s in statuses) else 0


def _stop_cores(handles: list[EngineCoreHandle]) -> list[int | None]:
    for handle in handles:  # closed first: every core starts stopping at once
        if handle.launcher_lifeline is not None:
            handle.launcher_lifeline.close()
    return [handle.stop() for handle in handles]


def _watch(front_ends: list, handles: list[EngineCoreHandle]) -> bool:
    """Passes signals on until every front end has exited; True when a process died by itself
    (a front end, or a core) rather than after a signal."""
    signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _: signals.append(s))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    failed = stopping = False
    try:
        while any(p.is_alive() for p in front_ends):
            while signals:
                sig = signals.pop(0)
                stopping = True
                logger.info("launcher got signal %d: passing it to the front ends", sig)
                _signal_all(front_ends, DRAIN_SIGNAL)
            gone = [p for p in front_ends if not p.is_alive()]
            dead = [h.process for h in handles if not h.process.is_alive()]
            if not (failed or stopping) and (gone or dead):
                failed = True
                what = (f"engine core {dead[0].name} (exit code {dead[0].exitcode})" if dead
                        else f"front end {gone[0].name} (exit code {gone[0].exitcode})")
                logger.error("%s exited: stopping the other processes", what)
                _signal_all(front_ends, DRAIN_SIGNAL)
            multiprocessing.connection.wait(
                [p.sentinel for p in front_ends] + [h.process.sentinel for h in handles],
                WATCH_INTERVAL)
        return failed
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_all(front_ends: list, sig: int) -> None:
    for process in front_ends:
        if process.is_alive():
            try:
                os.kill(process.pid, sig)
            except ProcessLookupError:
                pass


def front_end_main(index: int, addresses: list[str], info: EngineInfo, tokenizer: Any,
                   lifelines: list[multiprocessing.connection.Connection], config: ServerConfig,
                   sock: socket.socket, log_level: int) -> None:
    """A front-end process's entry point."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # the launcher's to count (module docstring)
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level or logging.INFO,
                        format=f"%(levelname)s %(asctime)s %(name)s [api server {index}]: "
                               "%(message)s")
    from jaxllm.serve.server import serve_forever

    from jaxllm.engine.core_client import EngineCoreClient

    client = EngineCoreClient(addresses, info, tokenizer, index, lifelines)
    started = time.monotonic()
    try:
        code = serve_forever(client, config, sock, stop_signals=(DRAIN_SIGNAL,))
    finally:
        signal.signal(DRAIN_SIGNAL, signal.SIG_IGN)
        client.shutdown()
    logger.info("front end %d stopped after %.0f s", index, time.monotonic() - started)
    raise SystemExit(code)
