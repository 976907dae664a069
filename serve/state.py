"""What the handlers share: the engine, the model's limits, admission and drain bookkeeping."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
import uuid
from typing import Any

from jaxllm.serve.args import ServerConfig
from jaxllm.serve.errors import APIError, bad_request, overloaded
from jaxllm.serve.metrics import Metrics
from jaxllm.serve.protocol import GenerationRequest
from jaxllm.serve.stats import MemoryMonitor, SnapshotCache

from jaxllm.engine.engine_client import EngineClient, EngineDeadError

logger = logging.getLogger("serve")


class Admission:
    """Bounds the requests accepted but not yet generating (the waiting queue), counted
    before any tokenizing. A ticket holds one slot per prompt; each slot is released when its
    prompt produces a first output or ends, and ``close()`` releases whatever is left."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.pending = 0

    def admit(self, slots: int) -> Ticket:
        if self.limit is not None and self.pending + slots > self.limit:
            raise overloaded(f"The server is overloaded: {self.pending} requests are waiting "
                             f"(--max-queue-len {self.limit}). Retry later.")
        self.pending += slots
        return Ticket(self, slots)


class Ticket:
    def __init__(self, admission: Admission, slots: int):
        self.admission = admission
        self.held = [True] * slots

    def release(self, index: int) -> None:
        if self.held[index]:
            self.held[index] = False
            self.admission.pending -= 1

    def close(self) -> None:
        for i in range(len(self.held)):
            self.release(i)


class ServerState:
    def __init__(self, engine: EngineClient, config: ServerConfig):
        self.engine = engine
        self.config = config
        info = engine.info
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = info.max_model_len
        self.max_num_seqs: int = info.max_num_seqs
        self.vocab_size: int = info.vocab_size
        self._grammars = engine.structured  # thread-safe compiler cache
        self.model_names = config.served_model_name or (info.model_name,)
        self.model_name = self.model_names[0]
        self.created = int(time.time())
        self.admission = Admission(config.max_queue_len)
        self.draining = False
        self.aborting = False  # past the drain deadline: requests not yet in the engine get 503
        self.active: set[str] = set()  # engine request ids in flight
        self.handlers = 0  # generation handlers running
        self._idle: asyncio.Event | None = None
        # One thread renders and tokenizes, off the event loop and one request at a time.
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, "jaxllm-tokenizer")
        self.snapshots = SnapshotCache(engine)
        self.memory = (MemoryMonitor(self.snapshots, config.memory_monitor_interval)
                       if config.memory_monitor else None)
        self.metrics = Metrics(self.model_name, self.max_model_len, {
            "block_size": str(info.block_size),
            "num_gpu_blocks": str(info.num_gpu_blocks),
            "num_cpu_blocks": str(info.num_cpu_blocks),
            "max_num_seqs": str(self.max_num_seqs),
            "max_model_len": str(self.max_model_len),
            "max_num_batched_tokens": str(info.max_num_batched_tokens),
            "gpu_memory_utilization": str(info.gpu_memory_utilization),
            "enable_prefix_caching": str(info.enable_prefix_caching),
        }, self.snapshots, self.memory)

    # --------------------------------------------------------------------- health
    @property
    def engine_alive(self) -> bool:
        return self.engine.dead_error is None

    def check_accepting(self) -> None:
        """503 while draining or after the engine died (before any other work)."""
        if self.draining:
            raise APIError("The server is shutting down.", 503,
                           headers={"Connection": "close"})
        if not self.engine_alive:
            raise APIError("The engine has stopped after an internal error; this server "
                           "cannot generate any more.", 503)

    # ------------------------------------------------------------------- requests
    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def begin(self) -> None:
        """A generation handler starts; shutdown waits for every one to end."""
        self.handlers += 1
        if self._idle is not None:
            self._idle.clear()

    def end(self) -> None:
        self.handlers -= 1
        if not self.handlers and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no generation handler runs, False if ``timeout`` passed first."""
        if not self.handlers:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return not self.handlers

    def abort_all(self) -> None:
        """Aborts every engine request of this server now (a second signal); no count."""
        self.aborting = True
        for request_id in list(self.active):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine may already be dead
                logger.debug("abort of %s failed", request_id, exc_info=True)

    async def abort_unfinished(self) -> int:
        """Aborts the requests of this server that the engine still runs; returns how many.

        Decided by the engine between two steps, so the count is exact: a request that
        has finished in the engine but whose handler has not yet read its final output (still
        in ``active``) is not aborted and not counted, and every request counted ends with
        ``finish_reason="abort"``. Requests still being tokenized get 503 (``aborting``)."""
        self.aborting = True
        try:
            return await self.engine.abort_unfinished(set(self.active))
        except EngineDeadError:  # its requests have failed already
            return 0

    async def in_tokenizer_thread(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, functools.partial(fn, *args))

    def compile_grammar(self, req: GenerationRequest) -> None:
        """Compiles the request's output constraint (tokenizer thread); 400 if it cannot."""
        if self._grammars is None:
            raise bad_request("structured outputs need a model with a tokenizer",
                              req.constraint_field)
        try:
            self._grammars.compile(req.params.structured_outputs)
        except ValueError as e:
            raise bad_request(str(e), req.constraint_field) from None

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one state per server, lives as long
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
