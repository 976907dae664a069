"""What an HTTP front end needs from an engine, wherever the engine runs: on a thread of this
process (:class:`~jaxllm.engine.async_engine.AsyncLLMEngine`) or in its own engine-core process
(:class:`~jaxllm.engine.core_client.EngineCoreClient`).

Both deliver each request's outputs into a per-request ``asyncio.Queue``; the consuming side,
:meth:`EngineClient.generate`, is this one implementation. An item in a request's queue is a
RequestOutput (or EmbeddingRequestOutput) or the exception that ends the request: the
ValueError of a refused ``add_request`` or an :class:`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterable
from typing import Any

from jaxllm.engine.outputs import RequestOutput
from jaxllm.engine.snapshot import EngineSnapshot
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import RequestOutputKind, SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an error; no request can be served."""


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """The engine's resolved limits and settings, as a front end reports and enforces them."""

    model_name: str  # --model as given, else the loaded model's name
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    gpu_memory_utilization: float
    enable_prefix_caching: bool

    @classmethod
    def of(cls, engine: Any) -> EngineInfo:  # an LLMEngine
        config, plan = engine.config, engine.kv_plan
        return cls(config.model or engine.model.name, config.max_model_len, config.max_num_seqs,
                   config.max_num_batched_tokens, engine.model.config.vocab_size,
                   tuple(engine.eos_token_ids), config.block_size, plan.num_gpu_blocks,
                   plan.num_cpu_blocks, config.gpu_memory_utilization,
                   config.enable_prefix_caching)


class EngineClient:
    """The front end's handle on an engine. Subclasses provide ``info``, ``tokenizer`` and
    ``structured`` (a thread-safe grammar compiler cache, jaxllm.structured, that validates a
    request's output constraint before it is queued: a 400, not an engine error), send
    requests and aborts (``_add``, ``abort``) and put what comes back into
    ``self._streams[request_id]``."""

    out_of_process = False  # True when the engine steps in another process
    info: EngineInfo
    tokenizer: Any
    structured: Any

    def __init__(self) -> None:
        self.dead_error: BaseException | None = None
        # request id -> (the event loop its consumer runs on, its output queue)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    # ------------------------------------------------------------- subclasses
    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    async def attach(self) -> None:
        """Called on the front end's event loop before it serves (a client of another process
        connects there)."""

    def _add(self, request_id: str, prompt: str | None,
             params: SamplingParams | PoolingParams | None,
             prompt_token_ids: list[int] | None, priority: int) -> None:
        """Queues the request without waiting; a refusal arrives in its stream."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Aborts a request from any thread; its blocks are freed before the next step."""
        raise NotImplementedError

    async def snapshot(self) -> EngineSnapshot:
        """The engine's state, taken between two steps."""
        raise NotImplementedError

    async def snapshots(self) -> list[EngineSnapshot]:
        """One snapshot per engine (data-parallel replica), whose total :meth:`snapshot` is."""
        return [await self.snapshot()]

    async def abort_unfinished(self, request_ids: Iterable[str]) -> int:
        """Aborts those of ``request_ids`` the engine still runs (waiting, running or swapped),
        decided between two steps so that the count is exact; returns how many."""
        raise NotImplementedError

    # ----------------------------------------------------------------- common
    @property
    def is_running(self) -> bool:
        return self.dead_error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")

    async def generate(self, request_id: str, prompt: str | None = None,
                       params: SamplingParams | PoolingParams | None = None, *,
                       prompt_token_ids: list[int] | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs (as ``params.output_kind`` asks) until the request finishes
        (an embedding request, ``PoolingParams``: one EmbeddingRequestOutput when it does).
        Raises ValueError for bad input and EngineDeadError if the engine dies. Closing the
        iterator early (client gone) aborts the request."""
        self.check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        delta = getattr(params, "output_kind", None) is RequestOutputKind.DELTA
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        finished = False
        try:
            self._add(request_id, prompt, params, prompt_token_ids, priority)
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = not isinstance(item, EngineDeadError)  # refused: not queued
                    raise item
                # When several outputs wait (the consumer fell behind the engine), they go out
                # as one: the newest cumulative output holds them all, delta outputs are
                # merged. That saves the consumer one write per step it missed. An error
                # behind them is raised on the next get.
                while not item.finished and not stream.empty():
                    newer = stream.get_nowait()
                    if isinstance(newer, BaseException):
                        stream.put_nowait(newer)
                        break
                    item = item.merge(newer) if delta else newer
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.dead_error is None:
                self.abort(request_id)

    def _fail_all(self, error: BaseException) -> None:
        """Every request in flight ends with ``error`` (the engine died)."""
        for loop, stream in list(self._streams.values()):
            loop.call_soon_threadsafe(stream.put_nowait, error)
