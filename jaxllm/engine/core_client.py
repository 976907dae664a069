"""EngineCoreClient: a front end's handle on the engine cores running in their own processes
(:mod:`jaxllm.engine.core_process`, which describes the messages and the lifeline): one, or
``--data-parallel-size`` replicas, each a whole engine over its own devices.

Everything here runs on the front end's event loop: :meth:`attach` (called by the server once
its loop runs) connects one DEALER socket per core and starts a reader on each, which turns
the cores' token deltas into RequestOutputs (text, stop strings:
:class:`~jaxllm.engine.request_outputs.RequestOutputProcessor`) and puts each into its
request's queue (:class:`~jaxllm.engine.engine_client.EngineClient`'s streams). A sample a stop
string ended here is finished here at once and stopped in its core ("stop").
A request goes to the replica :class:`~jaxllm.engine.load_balancer.LoadBalancer` picks, and its
abort to that replica; a call (snapshot, abort_unfinished) goes to every replica. Any core's
death is the engine's: every request in flight fails, as with one core.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing.connection
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from jaxllm.engine.core_process import EngineCoreHandle, dumps, frontend_identity
from jaxllm.engine.engine_client import EngineClient, EngineDeadError, EngineInfo
from jaxllm.engine.load_balancer import LoadBalancer, ReplicaLoad
from jaxllm.engine.request_outputs import RequestOutputProcessor, StopDecision
from jaxllm.engine.snapshot import EngineSnapshot, merge_snapshots
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCoreClient(EngineClient):
    out_of_process = True

    def __init__(self, addresses: Sequence[str], info: EngineInfo, tokenizer: Any, index: int,
                 lifelines: Sequence[multiprocessing.connection.Connection],
                 handles: Sequence[EngineCoreHandle] = ()):
        """``addresses``: each core's socket (one per data-parallel replica); ``index``: this
        front end's number (its routing id in every core); ``lifelines``: its end of the pipe
        it shares with each core; ``handles``: the cores themselves, when this process started
        them (one front end), so that :meth:`shutdown` stops them."""
        super().__init__()
        if len(addresses) != len(lifelines):
            raise ValueError(f"{len(addresses)} cores but {len(lifelines)} lifelines")
        self.info = info
        self.tokenizer = tokenizer
        self.structured = _grammar_cache(info, tokenizer)
        self.addresses = list(addresses)
        self.identity = frontend_identity(index)
        self.lifelines = list(lifelines)
        self.handles = list(handles)
        self.balancer = LoadBalancer(len(self.addresses), info.block_size, info.max_num_seqs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: zmq.asyncio.Context | None = None
        self._sockets: list[zmq.asyncio.Socket] = []
        self._readers: list[asyncio.Task] = []
        self._replica: dict[str, int] = {}  # request id -> the core that runs it
        self.processor = RequestOutputProcessor(tokenizer)  # this front end's requests
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()

    @classmethod
    def for_handle(cls, handle: EngineCoreHandle) -> EngineCoreClient:
        """The client of the one front end of a core this process started."""
        return cls.for_handles([handle])

    @classmethod
    def for_handles(cls, handles: Sequence[EngineCoreHandle]) -> EngineCoreClient:
        """The client of the one front end of the cores (replicas) this process started."""
        return cls([h.address for h in handles], handles[0].info, handles[0].tokenizer, 0,
                   [h.lifelines[0] for h in handles], handles)

    @property
    def num_replicas(self) -> int:
        return len(self.addresses)

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Nothing to start here: the cores run already; :meth:`attach` connects."""

    async def attach(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._context = zmq.asyncio.Context()
        for replica, address in enumerate(self.addresses):
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.IDENTITY, self.identity)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.setsockopt(zmq.RCVHWM, 0)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self._sockets.append(socket)
            self._readers.append(asyncio.create_task(self._read(replica)))
            self._loop.add_reader(self.lifelines[replica].fileno(), self._core_gone, replica)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for lifeline in self.lifelines:
                if not lifeline.closed:
                    try:
                        self._loop.remove_reader(lifeline.fileno())
                    except (ValueError, OSError, RuntimeError):
                        pass
        for reader in self._readers:
            if not reader.done():
                try:
                    reader.cancel()
                except RuntimeError:  # its loop has closed (asyncio.run ended)
                    pass
        for socket in self._sockets:
            socket.close(linger=0)
        if self._context is not None:
            self._context.term()
        self._readers, self._sockets, self._context = [], [], None
        handles, self.handles = self.handles, []
        for handle in handles:  # closed first: every core starts stopping at once
            for conn in [handle.launcher_lifeline, *handle.lifelines]:
                if conn is not None:
                    conn.close()
        for replica, handle in enumerate(handles):
            code = handle.stop(timeout)
            logger.info("engine-core process%s exited with code %s", _which(replica, handles),
                        code)

    # ----------------------------------------------------------------- requests
    def _add(self, request_id: str, prompt: str | None,
             params: SamplingParams | PoolingParams | None,
             prompt_token_ids: list[int] | None, priority: int) -> None:
        replica = self.balancer.choose(prompt_token_ids)
        self._replica[request_id] = replica
        if not isinstance(params, PoolingParams):
            self.processor.add_request(request_id, prompt, prompt_token_ids,
                                       params or SamplingParams())
        self.balancer.added(replica)
        self._send(replica, ("add", request_id, prompt, params, prompt_token_ids, priority))

    def abort(self, request_id: str) -> None:
        replica = self._replica.get(request_id)
        if self.dead_error is None and replica is not None:
            self._send(replica, ("abort", [request_id]))

    async def snapshot(self) -> EngineSnapshot:
        """The replicas' totals (:func:`~jaxllm.engine.snapshot.merge_snapshots`)."""
        return merge_snapshots(await self.snapshots())

    async def snapshots(self) -> list[EngineSnapshot]:
        per_replica = await asyncio.gather(*(self._call(replica, "snapshot")
                                             for replica in range(self.num_replicas)))
        for replica, s in enumerate(per_replica):  # fresher than its last load report, maybe
            self.balancer.report(replica, ReplicaLoad(s.waiting + s.swapped, s.running,
                                                      s.kv_usage))
        return per_replica

    async def abort_unfinished(self, request_ids: Iterable[str]) -> int:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            replica = self._replica.get(request_id)
            if replica is not None:  # else finished: its last output has arrived here
                by_replica.setdefault(replica, []).append(request_id)
        counts = await asyncio.gather(*(self._call(replica, "abort_unfinished", ids)
                                        for replica, ids in by_replica.items()))
        return sum(counts)

    async def _call(self, replica: int, name: str, *args: Any) -> Any:
        self.check_alive()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(replica, ("call", call_id, name, args))
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _send(self, replica: int, message: tuple) -> None:
        if not self._sockets:
            raise RuntimeError("EngineCoreClient.attach() has not run")
        socket, frame = self._sockets[replica], dumps(message)
        if self._loop is not None and _on_loop(self._loop):
            socket.send(frame, copy=False)  # HWM off: queued at once, never dropped
        else:  # from another thread: sockets are not thread-safe
            self._loop.call_soon_threadsafe(socket.send, frame)

    def _release(self, request_id: str) -> None:
        replica = self._replica.pop(request_id, None)
        if replica is not None:
            self.balancer.finished(replica)

    # ------------------------------------------------------------------ replies
    async def _read(self, replica: int) -> None:
        socket = self._sockets[replica]
        while True:
            payload = await socket.recv()
            try:
                self._dispatch(replica, pickle.loads(payload))
            except Exception:  # a bug here must not stop every later output
                logger.exception("bad message from the engine core")

    def _dispatch(self, replica: int, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            outputs, stops = self.processor.process(message[1])
            if stops:
                self._stop(replica, stops)
            for output in outputs:
                self._deliver(output)
        elif kind == "load":
            self.balancer.report(replica, ReplicaLoad(*message[1:4]))
        elif kind == "refused":
            _, request_id, error = message
            self.processor.forget(request_id)
            self._release(request_id)
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

    def _stop(self, replica: int, stops: list[StopDecision]) -> None:
        """Stops in the core the samples a stop string ended here (their final outputs
        have gone out from here; the core frees their blocks and sends nothing more that
        is shown)."""
        if self.dead_error is None:
            self._send(replica, ("stop", stops))

    def _deliver(self, output: Any) -> None:
        request_id = output.request_id
        if output.finished:
            self._release(request_id)
        self._put(request_id, output)

    def _put(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            target[1].put_nowait(item)

    def _core_gone(self, replica: int) -> None:
        self._loop.remove_reader(self.lifelines[replica].fileno())
        code = None
        if self.handles:
            self.handles[replica].process.join(5)
            code = self.handles[replica].process.exitcode
        which = _which(replica, self.addresses)
        if self.dead_error is None:
            self._die(EngineDeadError(f"the engine-core process{which} exited (exit code "
                                      f"{code})"))
        logger.error("the engine-core process%s is gone (exit code %s)", which, code)

    def _die(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = error
        self.processor.requests.clear()
        self._fail_all(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)


def _which(replica: int, replicas: Sequence) -> str:
    """" of replica i" in messages, when there are several."""
    return f" of replica {replica}" if len(replicas) > 1 else ""


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
