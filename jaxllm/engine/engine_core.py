"""What runs inside the engine-core process: its entry point (``run_engine_core``, spawned by
:func:`jaxllm.engine.core_process.launch_engine_core`) and the loop that steps the engine
between the front ends' messages (``EngineCore``). The messages, the transport and the
lifelines are described in :mod:`jaxllm.engine.core_process`.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any

import zmq

from jaxllm.engine import gc_watch
from jaxllm.engine.core_process import dumps, output_request_id, picklable_error
from jaxllm.engine.engine_client import EngineInfo
from jaxllm.engine.engine_config import EngineConfig

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 1000  # how long an idle core sleeps in one poll (any message wakes it)
# Seconds between two load reports of a busy core: fresh enough for a front end's routing (its
# own requests in flight are counted as they go), a few tiny messages a second.
LOAD_INTERVAL = 0.05


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
