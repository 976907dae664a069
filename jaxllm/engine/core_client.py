"""EngineCoreClient: a front end's handle on an engine core running in its own process
(:mod:`jaxllm.engine.core_process`, which describes the messages and the lifeline).

Everything here runs on the front end's event loop: :meth:`attach` (called by the server once
its loop runs) connects the DEALER socket and starts the reader, which puts each output into
its request's queue (:class:`~jaxllm.engine.engine_client.EngineClient`'s streams).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing.connection
import pickle
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.asyncio

from jaxllm.engine.core_process import EngineCoreHandle, dumps, frontend_identity
from jaxllm.engine.engine_client import EngineClient, EngineDeadError, EngineInfo
from jaxllm.engine.outputs import RequestOutput
from jaxllm.engine.snapshot import EngineSnapshot
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCoreClient(EngineClient):
    out_of_process = True

    def __init__(self, address: str, info: EngineInfo, tokenizer: Any, index: int,
                 lifeline: multiprocessing.connection.Connection,
                 handle: EngineCoreHandle | None = None):
        """``index``: this front end's number (its routing id); ``lifeline``: its end of the
        pipe it shares with the core; ``handle``: the core itself, when this process started
        it (one front end), so that :meth:`shutdown` stops it."""
        super().__init__()
        self.info = info
        self.tokenizer = tokenizer
        self.structured = _grammar_cache(info, tokenizer)
        self.address = address
        self.identity = frontend_identity(index)
        self.lifeline = lifeline
        self.handle = handle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()

    @classmethod
    def for_handle(cls, handle: EngineCoreHandle) -> EngineCoreClient:
        """The client of the one front end of a core this process started."""
        return cls(handle.address, handle.info, handle.tokenizer, 0, handle.lifelines[0],
                   handle)

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Nothing to start here: the core runs already; :meth:`attach` connects."""

    async def attach(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, self.identity)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        self._socket = socket
        self._reader = asyncio.create_task(self._read())
        self._loop.add_reader(self.lifeline.fileno(), self._core_gone)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._loop is not None and not self._loop.is_closed() and not self.lifeline.closed:
            try:
                self._loop.remove_reader(self.lifeline.fileno())
            except (ValueError, OSError, RuntimeError):
                pass
        if self._reader is not None and not self._reader.done():
            try:
                self._reader.cancel()
            except RuntimeError:  # its loop has closed (asyncio.run ended)
                pass
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._context is not None:
            self._context.term()
        self._reader = self._socket = self._context = None
        handle, self.handle = self.handle, None
        if handle is not None:
            code = handle.stop(timeout)
            logger.info("engine-core process exited with code %s", code)

    # ----------------------------------------------------------------- requests
    def _add(self, request_id: str, prompt: str | None,
             params: SamplingParams | PoolingParams | None,
             prompt_token_ids: list[int] | None, priority: int) -> None:
        self._send(("add", request_id, prompt, params, prompt_token_ids, priority))

    def abort(self, request_id: str) -> None:
        if self.dead_error is None:
            self._send(("abort", [request_id]))

    async def snapshot(self) -> EngineSnapshot:
        return await self._call("snapshot")

    async def abort_unfinished(self, request_ids: Iterable[str]) -> int:
        return await self._call("abort_unfinished", list(request_ids))

    async def _call(self, name: str, *args: Any) -> Any:
        self.check_alive()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(("call", call_id, name, args))
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _send(self, message: tuple) -> None:
        if self._socket is None:
            raise RuntimeError("EngineCoreClient.attach() has not run")
        frame = dumps(message)
        if self._loop is not None and _on_loop(self._loop):
            self._socket.send(frame, copy=False)  # HWM off: queued at once, never dropped
        else:  # from another thread: sockets are not thread-safe
            self._loop.call_soon_threadsafe(self._socket.send, frame)

    # ------------------------------------------------------------------ replies
    async def _read(self) -> None:
        while True:
            payload = await self._socket.recv()
            try:
                self._dispatch(pickle.loads(payload))
            except Exception:  # a bug here must not stop every later output
                logger.exception("bad message from the engine core")

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            for output in message[1]:
                self._deliver(output)
        elif kind == "refused":
            _, request_id, error = message
            self._put(request_id, error)
        elif kind == "reply":
            _, call_id, ok, value = message
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)
        elif kind == "dead":
            self._die(EngineDeadError(message[1]))

    def _deliver(self, output: Any) -> None:
        request_id = output.request_id
        if isinstance(output, RequestOutput):
            if output.prompt_token_ids is None:  # sent with the first output only
                output.prompt, output.prompt_token_ids = self._prompts.get(request_id,
                                                                           (None, []))
            elif not output.finished:
                self._prompts[request_id] = (output.prompt, output.prompt_token_ids)
        if output.finished:
            self._prompts.pop(request_id, None)
        self._put(request_id, output)

    def _put(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            target[1].put_nowait(item)

    def _core_gone(self) -> None:
        self._loop.remove_reader(self.lifeline.fileno())
        code = None
        if self.handle is not None:
            self.handle.process.join(5)
            code = self.handle.process.exitcode
        if self.dead_error is None:
            self._die(EngineDeadError(f"the engine-core process exited (exit code {code})"))
        logger.error("the engine-core process is gone (exit code %s)", code)

    def _die(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = error
        self._fail_all(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _grammar_cache(info: EngineInfo, tokenizer: Any) -> Any:
    """This front end's own grammar compiler, to refuse a bad constraint with a 400 before the
    request reaches the core (which compiles it again for its matchers, cached by schema)."""
    if tokenizer is None:
        return None
    from jaxllm.structured import GrammarCompiler, StructuredOutputs

    return StructuredOutputs(GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids))
