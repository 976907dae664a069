"""The engine core in its own process: the LLMEngine's step loop, with no HTTP work and no
event loop sharing its GIL (the front ends tokenize, render and stream in theirs).

Transport: one ZMQ ROUTER socket on an ``ipc://`` path in a private (0700) temporary directory;
each front end connects a DEALER with its own routing id (``fe<i>``). Messages are pickled
tuples (protocol 5):

    front end -> core   ("add", request_id, prompt, params, prompt_token_ids, priority)
                        ("abort", [request_id, ...])
                        ("stop", [(request_id, sample index, stop string), ...])  a stop
                                                              string the front end found
                        ("call", call_id, "snapshot" | "abort_unfinished", args)
    core -> front end   ("outputs", [token delta tuple | EmbeddingRequestOutput, ...])  one a
                                                              step (jaxllm.engine.request_outputs)
                        ("refused", request_id, exception)    add_request raised
                        ("reply", call_id, ok, value | exception)
                        ("dead", message)                     a step failed; the core exits 1
                        ("load", waiting, running, kv_usage)  to every front end, at most every
                                                              LOAD_INTERVAL while busy and once
                                                              on going idle (load balancing)

Why ZMQ: its I/O threads do the socket writes, so the engine loop's send of a step's outputs is
a queue push, and a slow front end never blocks the loop (high-water marks are off: an output
is never dropped). Why pickle: the payloads are the engine's own types, and no schema has to
be kept beside them. A step's outputs travel as plain tuples of new token ids
(:func:`jaxllm.engine.request_outputs.core_output`): pickling RequestOutput dataclasses cost 3x
more on the engine's thread and 7x more to read (``benchmarks/ipc_step.py``, RESULTS), and a
request's prompt and prompt ids travel with its first output only (the client keeps them).
The core does not detokenize: each front end turns its requests' tokens into text and
applies stop strings (:class:`jaxllm.engine.request_outputs.RequestOutputProcessor`), and
sends "stop" for a sample a stop string ended, so that the core frees its blocks.
The socket lives in a directory only this user can enter, so only this user's processes can
speak to it.

Liveness: each front end and the core share a pipe (a "lifeline") on which nothing is ever
written. A process's death closes its ends, so the other side sees end-of-file at once,
whatever the cause (exception, SIGKILL, out-of-memory killer): the core aborts a dead front
end's requests, and exits when the process that started it is gone; a front end whose core is
gone fails its requests and reports the engine dead (``/health`` 503, exit status 1).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

import zmq

from jaxllm.engine import gc_watch
from jaxllm.engine.engine_client import EngineInfo
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.replica_devices import replica_device_env

logger = logging.getLogger(__name__)
PICKLE = pickle.HIGHEST_PROTOCOL
IDLE_POLL_MS = 1000  # how long an idle core sleeps in one poll (any message wakes it)
# Seconds between two load reports of a busy core: fresh enough for a front end's routing (its
# own requests in flight are counted as they go), a few tiny messages a second.
LOAD_INTERVAL = 0.05


def frontend_identity(index: int) -> bytes:
    return f"fe{index}".encode()


def dumps(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=PICKLE)


def output_request_id(output: Any) -> str:
    """The request id of an output the engine core sends (a token delta tuple or an
    EmbeddingRequestOutput)."""
    return output[0] if type(output) is tuple else output.request_id


def picklable_error(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error, protocol=PICKLE))
        return error
    except Exception:  # noqa: BLE001 - any exception may refuse to pickle
        return RuntimeError(f"{type(error).__name__}: {error}")


class EngineStartError(RuntimeError):
    """The engine-core process failed before it was ready (its message says why)."""


@dataclasses.dataclass
class EngineCoreHandle:
    """What the launching process holds of a started engine core."""

    process: multiprocessing.process.BaseProcess
    address: str
    info: EngineInfo
    tokenizer: Any
    # One per front end: its end of that front end's lifeline (hand each to its front end).
    lifelines: list[multiprocessing.connection.Connection]
    # The launcher's own lifeline when it is not a front end (N > 1 front ends), else None.
    launcher_lifeline: multiprocessing.connection.Connection | None
    socket_dir: str

    def stop(self, timeout: float = 10.0) -> int | None:
        """Closes the launcher's lifelines (the core exits on that), waits, and removes the
        socket directory; returns the core's exit code (killed past ``timeout``)."""
        for conn in [self.launcher_lifeline, *self.lifelines]:
            if conn is not None:
                conn.close()
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine-core process did not exit within %.0f s: killing it",
                           timeout)
            self.process.kill()
            self.process.join(5)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        return self.process.exitcode


def launch_engine_core(config: EngineConfig, num_frontends: int = 1) -> EngineCoreHandle:
    """Starts the engine core in a new (spawned) process and waits until its engine is ready:
    weights loaded, KV cache allocated, step programs compiled or read from the cache. Raises
    EngineStartError with the core's own message when it fails first (a bad flag, out of
    memory, a checkpoint that cannot be read) or dies without one."""
    return launch_engine_cores(config, num_frontends)[0]


def launch_engine_cores(config: EngineConfig, num_frontends: int = 1,
                        data_parallel_size: int = 1) -> list[EngineCoreHandle]:
    """``data_parallel_size`` engine cores, replicas of the model each over its own devices
    (:mod:`jaxllm.engine.replica_devices`), started together and each waited for as
    :func:`launch_engine_core` does; when one fails, the others are stopped and its error
    raised."""
    tp = config.tensor_parallel_size * config.pipeline_parallel_size  # devices a replica uses
    try:
        envs = [replica_device_env(replica, tp, os.environ)
                for replica in range(data_parallel_size)]
    except ValueError as e:
        raise EngineStartError(str(e)) from None
    starting = [_start(config, num_frontends, replica, data_parallel_size, env)
                for replica, env in enumerate(envs)]
    handles: list[EngineCoreHandle] = []
    error: EngineStartError | None = None
    for start in starting:
        try:
            handles.append(start())
        except EngineStartError as e:
            error = error or e
    if error is not None:
        for handle in handles:
            handle.stop()
        raise error
    return handles


def _start(config: EngineConfig, num_frontends: int, replica: int, num_replicas: int,
           env: dict[str, str]):
    """Spawns one engine core; returns the function that waits for it to be ready."""
    ctx = multiprocessing.get_context("spawn")  # fork is unsafe once JAX has threads
    socket_dir = tempfile.mkdtemp(prefix="jaxllm-engine-")  # mode 0700
    address = f"ipc://{os.path.join(socket_dir, 'core.sock')}"
    pairs = [ctx.Pipe(duplex=True) for _ in range(num_frontends)]
    launcher = ctx.Pipe(duplex=True) if num_frontends > 1 else None
    core_lifelines = [(frontend_identity(i), core_end) for i, (_, core_end) in enumerate(pairs)]
    # The core exits when its parent's lifeline closes: the one front end's, or the launcher's.
    parent = 0 if launcher is None else len(core_lifelines)
    if launcher is not None:
        core_lifelines.append((None, launcher[1]))
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    name = "jaxllm-engine-core" + (f"-{replica}" if num_replicas > 1 else "")
    label = "engine core" + (f" {replica}" if num_replicas > 1 else "")
    process = ctx.Process(target=run_engine_core, name=name, daemon=True,
                          args=(config, address, core_lifelines, parent, ready_send,
                                logging.getLogger().level, env, label))
    process.start()
    for _, conn in core_lifelines:
        conn.close()
    ready_send.close()

    def wait_ready() -> EngineCoreHandle:
        try:
            message = ready_recv.recv()
        except EOFError:
            message = ("error", None)
        finally:
            ready_recv.close()
        if message[0] != "ready":
            process.join(30)
            shutil.rmtree(socket_dir, ignore_errors=True)
            reason = message[1] or (f"the engine-core process exited with code "
                                    f"{process.exitcode} before it was ready")
            raise EngineStartError(reason)
        _, info, tokenizer = message
        return EngineCoreHandle(process, address, info, tokenizer, [end for end, _ in pairs],
                                None if launcher is None else launcher[0], socket_dir)

    return wait_ready


def run_engine_core(config: EngineConfig, address: str, lifelines: list, parent: int,
                    ready: multiprocessing.connection.Connection, log_level: int,
                    env: dict[str, str] | None = None, label: str = "engine core") -> None:
    """The engine-core process's entry point (spawned by :func:`launch_engine_core`)."""
    os.environ.update(env or {})  # before JAX starts its backends (LLMEngine, below)
    # Ctrl-C, or a SIGTERM sent to the whole process group (GNU timeout, a shell's job
    # control), reaches this process too: it must outlive the front end's drain. The front end
    # closing its lifeline (it exited, however) is how this process is told to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level or logging.INFO,
                        format=f"%(levelname)s %(asctime)s %(name)s [{label}]: %(message)s")
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.errors import JaxLLMError

    try:
        engine = LLMEngine(config, usage_context="api_server")  # the server's defaults
    except (JaxLLMError, ValueError, OSError) as e:
        ready.send(("error", str(e)))
        sys.exit(1)
    except BaseException:
        ready.send(("error", "the engine failed to start:\n" + traceback.format_exc()))
        sys.exit(1)
    engine.stream_outputs = True
    engine.ship_token_deltas()  # the front ends detokenize
    core = EngineCore(engine, address, lifelines, parent)
    # This process holds one engine for its life: what start-up allocated (weights' host
    # objects, compiled programs, the tokenizer) moves out of the collector's generations, so
    # a full collection walks only what serving allocates (at 1,024 running sequences one
    # took 155-165 ms of a step, 65-84 ms after a freeze: benchmarks/gc_pause.py), as vLLM's
    # engine core does.
    gc_watch.settle(logger, "engine core")
    ready.send(("ready", EngineInfo.of(engine), engine.tokenizer))
    ready.close()
    sys.exit(core.run())


class EngineCore:
    def __init__(self, engine: Any, address: str, lifelines: list, parent: int):
        self.engine = engine
        self.context = zmq.Context(io_threads=1)
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.lifelines = dict(enumerate(lifelines))  # index -> (front-end id | None, conn)
        self.parent = parent
        self.owner: dict[str, bytes] = {}  # request id -> the front end that sent it
        self.prompt_sent: set[str] = set()  # requests whose first output has gone out
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        for _, conn in self.lifelines.values():
            self.poller.register(conn.fileno(), zmq.POLLIN)
        self.stopping = False
        self._load_sent: tuple | None = None
        self._load_time = 0.0

    def run(self) -> int:
        """Steps until the parent's lifeline closes (0) or a step fails (1)."""
        try:
            while not self.stopping:
                busy = self.engine.has_unfinished_requests()
                events = dict(self.poller.poll(0 if busy else IDLE_POLL_MS))
                if events:
                    self._handle(events)
                if self.stopping:
                    continue
                self._report_load()
                if not self.engine.has_unfinished_requests():
                    continue
                try:
                    outputs = self.engine.step()
                except BaseException as e:  # noqa: BLE001 - every front end must hear of it
                    logger.exception("engine step failed; failing all requests in flight")
                    self._broadcast(("dead", f"engine step failed: {e!r}"))
                    return 1
                self._send_outputs(outputs)
            return 0
        finally:
            self.socket.close(linger=1000)  # a last "dead" message still goes out
            self.context.term()

    # ------------------------------------------------------------------- input
    def _handle(self, events: dict) -> None:
        for index, (identity, conn) in list(self.lifelines.items()):
            if conn.fileno() in events:  # nothing is written there: this is end-of-file
                self.poller.unregister(conn.fileno())
                del self.lifelines[index]
                if index == self.parent:
                    logger.info("the process that started the engine core has closed its "
                                "lifeline: stopping")
                    self.stopping = True
                    return
                self._front_end_gone(identity)
        if self.socket in events:
            while True:
                try:
                    identity, payload = self.socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._dispatch(identity, pickle.loads(payload))

    def _dispatch(self, identity: bytes, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params, prompt_token_ids, priority = message
            try:
                self.engine.add_request(request_id, prompt, params,
                                        prompt_token_ids=prompt_token_ids, priority=priority)
            except BaseException as e:  # noqa: BLE001 - the front end answers it (a 400)
                self._send(identity, ("refused", request_id, picklable_error(e)))
                return
            self.owner[request_id] = identity
        elif kind == "abort":
            self._send_outputs(self.engine.abort_request(
                [r for r in message[1] if self.owner.get(r) == identity]))
        elif kind == "stop":  # its final output goes at the next step (the front end has
            self.engine.stop_sequences(  # sent its own already, and ignores this one)
                [s for s in message[1] if self.owner.get(s[0]) == identity])
        elif kind == "call":
            _, call_id, name, args = message
            try:
                value, ok = self._call(name, *args), True
            except BaseException as e:  # noqa: BLE001
                value, ok = picklable_error(e), False
            self._send(identity, ("reply", call_id, ok, value))
        else:
            logger.error("unknown message %r from %r: ignored", kind, identity)

    def _call(self, name: str, *args: Any) -> Any:
        from jaxllm.engine.snapshot import take_snapshot, unfinished_request_ids

        if name == "snapshot":
            return take_snapshot(self.engine)
        if name == "abort_unfinished":
            unfinished = unfinished_request_ids(self.engine, set(args[0]))
            self._send_outputs(self.engine.abort_request(unfinished))
            return len(unfinished)
        raise ValueError(f"unknown call {name!r}")

    def _front_end_gone(self, identity: bytes) -> None:
        mine = [r for r, owner in self.owner.items() if owner == identity]
        logger.log(logging.ERROR if mine else logging.INFO,
                   "front end %s is gone: aborting its %d requests", identity.decode(),
                   len(mine))
        for output in self.engine.abort_request(mine):
            self._forget(output_request_id(output))

    # ------------------------------------------------------------------ output
    def _send_outputs(self, outputs: list) -> None:
        batches: dict[bytes, list] = {}
        for output in outputs:
            request_id = output_request_id(output)
            identity = self.owner.get(request_id)
            if identity is None:
                continue
            if type(output) is tuple:  # a token delta (request_outputs.core_output)
                finished = output[3]
                if request_id in self.prompt_sent:
                    # The metrics are fixed from the first token (the first output) until
                    # the finish: in between, each row goes without them (~half its bytes).
                    output = (request_id, None, None, finished,
                              output[4] if finished else None, output[5])
                else:
                    self.prompt_sent.add(request_id)
            else:
                finished = output.finished
            batches.setdefault(identity, []).append(output)
            if finished:
                self._forget(request_id)
        for identity, batch in batches.items():
            self._send(identity, ("outputs", batch))

    def _report_load(self) -> None:
        now = time.monotonic()
        scheduler = self.engine.scheduler
        load = (len(scheduler.waiting) + len(scheduler.swapped), len(scheduler.running),
                self.engine.block_manager.usage)
        if load == self._load_sent or (now - self._load_time < LOAD_INTERVAL and any(load)):
            return  # unchanged, or busy and reported moments ago (going idle is sent at once)
        self._load_sent, self._load_time = load, now
        self._broadcast(("load", *load))

    def _forget(self, request_id: str) -> None:
        self.owner.pop(request_id, None)
        self.prompt_sent.discard(request_id)

    def _send(self, identity: bytes, message: tuple) -> None:
        self.socket.send_multipart([identity, dumps(message)], copy=False)

    def _broadcast(self, message: tuple) -> None:
        for identity, _ in self.lifelines.values():
            if identity is not None:
                self._send(identity, message)
