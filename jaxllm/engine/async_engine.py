"""AsyncLLMEngine: the engine's step loop on a background thread, per-request async streams.

Only the engine thread touches the LLMEngine. Requests and aborts from asyncio code are
queued to it and applied between steps; outputs flow back into each request's
``asyncio.Queue`` through ``call_soon_threadsafe``. A failing step fails every request in
flight with :class:`EngineDeadError` and stops the loop (``/health`` turns 503).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from jaxllm.engine.engine_client import EngineClient, EngineDeadError, EngineInfo
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.outputs import RequestOutput
from jaxllm.engine.snapshot import EngineSnapshot, take_snapshot, unfinished_request_ids
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine", "EngineDeadError"]

logger = logging.getLogger(__name__)


class AsyncLLMEngine(EngineClient):
    def __init__(self, engine: LLMEngine, *, idle_wait: float = 0.05):
        super().__init__()
        self.engine = engine
        engine.stream_outputs = True  # every step's partial outputs feed the streams
        self._idle_wait = idle_wait
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_step_time = 0.0

    @functools.cached_property
    def info(self) -> EngineInfo:
        return EngineInfo.of(self.engine)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def structured(self) -> Any:
        return self.engine.structured

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jaxllm-engine",
                                            daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # ----------------------------------------------------------------- requests
    def _add(self, request_id: str, prompt: str | None,
             params: SamplingParams | PoolingParams | None,
             prompt_token_ids: list[int] | None, priority: int) -> None:
        loop, stream = self._streams[request_id]

        def add() -> None:
            if self.dead_error is not None:
                error = EngineDeadError(f"engine is dead: {self.dead_error!r}")
                loop.call_soon_threadsafe(stream.put_nowait, error)
                return
            try:
                self.engine.add_request(request_id, prompt, params,
                                        prompt_token_ids=prompt_token_ids,
                                        arrival_time=time.monotonic(), priority=priority)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(stream.put_nowait, e)

        self._submit(add)

    def abort(self, request_id: str) -> None:
        """Aborts a request from any thread; its blocks are freed before the next step."""
        self._submit(lambda: self._deliver(self.engine.abort_request(request_id)))

    def run_in_engine(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Runs ``fn(engine)`` on the engine thread between steps (e.g. to read stats)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def call() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001
                loop.call_soon_threadsafe(_resolve, future, None, e)
            else:
                loop.call_soon_threadsafe(_resolve, future, result)

        self._submit(call)
        return future

    async def snapshot(self) -> EngineSnapshot:
        return await self.run_in_engine(take_snapshot)

    async def abort_unfinished(self, request_ids: Iterable[str]) -> int:
        ids = set(request_ids)

        def abort(engine: LLMEngine) -> int:
            unfinished = unfinished_request_ids(engine, ids)
            self._deliver(engine.abort_request(unfinished))
            return len(unfinished)

        return await self.run_in_engine(abort)

    def _submit(self, command: Callable[[], None]) -> None:
        self.check_alive()
        self._commands.put(command)
        self._wake.set()

    # -------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(self._idle_wait)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as e:  # noqa: BLE001 - every request must hear of it
                logger.exception("engine step failed; failing all requests in flight")
                self._die(e)
                return
            self.last_step_time = time.monotonic()
            self._deliver(outputs)
        self._drain_commands()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One wake-up of each event loop per step, not one per output: each
        # call_soon_threadsafe writes to the loop's self-pipe (a syscall on this thread).
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            target = self._streams.get(output.request_id)
            if target is not None:
                loop, stream = target
                batches.setdefault(loop, []).append((stream, output))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _die(self, error: BaseException) -> None:
        self.dead_error = error
        dead = EngineDeadError(f"engine step failed: {error!r}")
        self._fail_all(dead)
        self._drain_failed_commands(dead)

    def _drain_failed_commands(self, error: BaseException) -> None:
        # Requests queued but never added would otherwise wait forever on `added`.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except BaseException:  # noqa: BLE001
                logger.debug("dropping a command after engine death", exc_info=True)


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream, output in batch:
        stream.put_nowait(output)


def _resolve(future: asyncio.Future, value: Any, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
