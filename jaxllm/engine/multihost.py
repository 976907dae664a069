"""Multi-host serving: one model over the devices of several processes (one a host), as JAX's
multi-controller SPMD: every process launches the same compiled programs, in the same order,
with the same arguments, and XLA's collectives run between them.

Start-up, on every node (the same flags but ``--node-rank``, and ``--headless`` on workers):

1. :meth:`NodeGroup.join`: ``jax.distributed.initialize`` (:mod:`jaxllm.parallel.distributed`);
   the leader (node rank 0) listens for the workers' step channels on ``master_port + 1``,
   and each worker connects to it at once, so that either side's death is seen from here on.
2. The same :class:`~jaxllm.engine.llm_engine.LLMEngine` is built on every node: each reads
   its shards of the weights, allocates its part of the KV pool (the block count the smallest
   any node's memory allows: :meth:`NodeGroup.agree_kv_plan`; no swap space, since a swap
   would read shards of other hosts) and compiles the same step programs.
3. The leader waits for every worker's channel (:meth:`NodeGroup.broadcaster`) and serves;
   a worker replays (:class:`StepReplayer`) until the leader says stop.

Each step, the leader's :class:`~jaxllm.engine.model_runner.ModelRunner` sends every device
launch before making it, as ``(op, *host arguments)``: ``("forward", index, (shape, pooling,
batch, prev_rows), prev_index)``, ``("sample", forward_index, key, metadata)``,
``("copy_blocks", src, dst)``; and before compiling a program mid-run, ``("compile", kind,
key)``, so that every node compiles it at once rather than a worker only when the launch
arrives. The arguments are the numpy arrays the launch itself takes (packed batch, sampling
metadata, block ids); device results (logits, the sampled tokens a later forward reads) are
named by index, and each worker keeps its own. The scheduler, block manager, detokenizer and
HTTP server run on the leader only.

The side channel: one TCP connection per worker, each message a length-prefixed pickle
(protocol 5). Chosen over ``jax.experimental.multihost_utils.broadcast_one_to_all``, which is
itself a device collective on every node's step path (a program per payload shape, a
host-device round trip, and on a dead peer a hang inside XLA); the socket's connection
doubles as the lifeline. NOTE: measured on CPU (``benchmarks/multihost_step.py``, RESULTS.md
"Issue 18", a loaded 2-core host): a decode step's two messages (4-93 KB at 8-256 rows) cost
the leader 0.17-0.22 ms (pickling most of it) and a worker 0.05-0.07 ms to unpickle, against
61-87 ms for ``broadcast_one_to_all`` of the same arrays between two gloo CPU processes.

Liveness: the leader reads each worker's channel on a watchdog thread (workers never write
after their hello), and a worker reads the leader's on its receiver thread. A process's death
closes its sockets, so the other side sees end-of-file at once and exits with status 1
(``EXIT_PEER_LOST``) rather than hang in a collective with a dead peer; on the leader's
engine-core process that makes the HTTP server report the engine dead (``/health`` 503) and
exit 1. TCP keepalives (and ``TCP_USER_TIMEOUT``) find a host that vanished without closing
anything within about 15 s, and JAX's coordination-service heartbeat
(:data:`~jaxllm.parallel.distributed.HEARTBEAT_TIMEOUT`) is the backstop. A leader that stops
cleanly sends ``("stop",)`` first: its workers exit 0.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import pickle
import queue
import socket
import struct
import sys
import threading
import time
from typing import Any

import jax

from jaxllm.engine.engine_config import EngineConfig
from jaxllm.parallel import distributed

logger = logging.getLogger(__name__)
STEP_CHANNEL_PORT_OFFSET = 1  # the leader's step channel: master_port + 1
EXIT_PEER_LOST = 1
_HEADER = struct.Struct("!Q")
_KEEPALIVE = {"TCP_KEEPIDLE": 5, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3}  # seconds, probes
_USER_TIMEOUT_MS = 15_000  # unacknowledged data for this long: the peer's host is gone
STOP_GRACE = 30  # seconds a worker may take to exit after the leader's stop


def frame(message: tuple) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def read_message(sock: socket.socket) -> tuple:
    """The next message; EOFError when the peer closed the connection."""
    (size,) = _HEADER.unpack(_read_exact(sock, _HEADER.size))
    return pickle.loads(_read_exact(sock, size))


def _read_exact(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the connection was closed")
        got += n
    return bytes(buffer)


def _tune(sock: socket.socket) -> None:
    """No Nagle delay (a step's message goes out at once); keepalives and a user timeout, so
    that a peer whose host vanished is noticed within seconds."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE.items():
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timing
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, _USER_TIMEOUT_MS)


def exit_now(code: int, message: str, *args: Any) -> None:
    """Logs and ends this process at once: its main thread may be blocked in a collective
    that will never complete, so no cleanup can be waited for."""
    logger.critical(message, *args)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(code)


class NodeGroup:
    """This process's place among the nodes, from join to the step channel."""

    def __init__(self, config: EngineConfig, listener: socket.socket | None, deadline: float):
        self.config = config
        self.deadline = deadline  # time.monotonic() by which every node must be connected
        self.is_leader = config.node_rank == 0
        self._broadcaster: StepBroadcaster | None = None
        self.inbox: queue.Queue | None = None  # a worker's received messages
        if self.is_leader:
            self._broadcaster = StepBroadcaster(listener, config.nnodes - 1, deadline)
        else:
            self.inbox = _connect(config, deadline)

    @classmethod
    def join(cls, config: EngineConfig) -> NodeGroup:
        """Joins the JAX runtime of ``config.nnodes`` processes; must run before any JAX
        computation in this process."""
        timeout = distributed.init_timeout()
        deadline = time.monotonic() + timeout
        listener = None
        if config.node_rank == 0:  # bound first: a taken port fails before anything waits
            port = config.master_port + STEP_CHANNEL_PORT_OFFSET
            try:
                listener = socket.create_server(("", port), backlog=config.nnodes)
            except OSError as e:
                raise distributed.DistributedInitError(
                    f"the leader's step channel cannot listen on port {port} (--master-port "
                    f"{config.master_port} + 1): {e}") from None
        try:
            distributed.initialize(config.master_addr, config.master_port, config.nnodes,
                                   config.node_rank, timeout)
            distributed.check_node_devices(config.tensor_parallel_size,
                                           getattr(config, "pipeline_parallel_size", 1))
        except BaseException:
            if listener is not None:
                listener.close()
            raise
        return cls(config, listener, deadline)

    def agree_kv_plan(self, plan):
        """``plan`` with the fewest KV blocks any node can hold, and no swap space (a swap
        would copy shards that live on other hosts)."""
        blocks = distributed.agree_min(plan.num_gpu_blocks)
        if blocks != plan.num_gpu_blocks or plan.num_cpu_blocks:
            logger.info("KV blocks agreed by all %d nodes: %d (this node alone: %d); no swap "
                        "space across nodes", self.config.nnodes, blocks, plan.num_gpu_blocks)
        return dataclasses.replace(plan, num_gpu_blocks=blocks, num_cpu_blocks=0)

    def broadcaster(self) -> StepBroadcaster:
        """The leader's step channel once every worker is connected."""
        assert self._broadcaster is not None, "only the leader broadcasts"
        self._broadcaster.wait_connected()
        return self._broadcaster


class StepBroadcaster:
    """The leader's end of the step channels: accepts each worker's connection (on a thread,
    while the engine is built), watches it, and sends every device launch to all of them."""

    def __init__(self, listener: socket.socket, num_workers: int, deadline: float):
        self.num_workers = num_workers
        self.closing = False
        self._sockets: dict[int, socket.socket] = {}  # node rank -> connection
        self._error: str | None = None
        self._accepted = threading.Thread(target=self._accept, args=(listener, deadline),
                                          name="jaxllm-step-accept", daemon=True)
        self._accepted.start()
        atexit.register(self.close)

    def _accept(self, listener: socket.socket, deadline: float) -> None:
        with listener:
            while len(self._sockets) < self.num_workers:
                listener.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    sock, address = listener.accept()
                    sock.settimeout(10.0)
                    kind, rank = read_message(sock)  # ("hello", node rank)
                    sock.settimeout(None)
                except (OSError, EOFError, ValueError, pickle.UnpicklingError) as e:
                    if time.monotonic() >= deadline:
                        self._error = (f"{len(self._sockets)} of {self.num_workers} worker "
                                       f"nodes connected to the step channel in time ({e})")
                        return
                    continue
                _tune(sock)
                self._sockets[rank] = sock
                logger.info("worker node %d connected from %s", rank, address[0])
                threading.Thread(target=self._watch, args=(rank, sock), daemon=True,
                                 name=f"jaxllm-watch-node-{rank}").start()

    def wait_connected(self) -> None:
        self._accepted.join()
        if self._error is not None:
            raise distributed.DistributedInitError(self._error)

    def _watch(self, rank: int, sock: socket.socket) -> None:
        try:
            reason = "sent data it never sends" if sock.recv(1) else "closed its connection"
        except OSError as e:
            reason = str(e)
        if not self.closing:
            exit_now(EXIT_PEER_LOST, "worker node %d is gone (%s): the model's collectives "
                     "cannot complete without it; exiting", rank, reason)

    def send(self, message: tuple) -> None:
        data = frame(message)
        for sock in self._sockets.values():
            sock.sendall(data)

    def close(self) -> None:
        """Tells the workers to stop (they exit 0) and closes the channels; at an exit on an
        uncaught exception, only closes them (the workers exit 1 at once)."""
        if self.closing:
            return
        self.closing = True
        crashed = getattr(sys, "last_exc", None) is not None
        for sock in self._sockets.values():
            try:
                if not crashed:
                    sock.sendall(frame(("stop",)))
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def _connect(config: EngineConfig, deadline: float) -> queue.Queue:
    """A worker's connection to the leader's step channel, read on a thread into the queue
    returned; the thread ends this process when the connection drops without a stop."""
    port = config.master_port + STEP_CHANNEL_PORT_OFFSET
    error: Exception | None = None
    while True:
        try:
            sock = socket.create_connection((config.master_addr, port), timeout=5.0)
            break
        except OSError as e:
            error = e
        if time.monotonic() >= deadline:
            raise distributed.DistributedInitError(
                f"--node-rank {config.node_rank}: could not connect to the leader's step "
                f"channel at {config.master_addr}:{port} ({error})")
        time.sleep(0.25)
    sock.settimeout(None)
    _tune(sock)
    sock.sendall(frame(("hello", config.node_rank)))
    inbox: queue.Queue = queue.Queue()

    def receive() -> None:
        stopped = False
        try:
            while True:  # after a stop, until the leader's process closes the connection
                message = read_message(sock)
                stopped = stopped or message[0] == "stop"
                inbox.put(message)
        except (OSError, EOFError) as e:
            reason = str(e)
        if stopped:
            # The main thread exits 0 once it reads the stop; one still here after
            # STOP_GRACE is stuck (e.g. in a collective of an engine start the leader gave up).
            time.sleep(STOP_GRACE)
            exit_now(EXIT_PEER_LOST, "still running %d s after the leader stopped; exiting",
                     STOP_GRACE)
        exit_now(EXIT_PEER_LOST, "the leader (node 0) is gone: its step channel closed (%s); "
                 "exiting", reason)

    threading.Thread(target=receive, name="jaxllm-step-receive", daemon=True).start()
    return inbox


class StepReplayer:
    """A worker's loop: launches what the leader's runner launched, in its order, with its
    arguments; device results stay here, named by the leader's indices."""

    def __init__(self, runner: Any, inbox: queue.Queue):
        self.runner = runner
        self.inbox = inbox
        self.forwards: dict[int, Any] = {}  # forward index -> LaunchedForward
        self.pendings: dict[int, Any] = {}  # sampler index -> PendingStep
        self.launches: collections.Counter = collections.Counter()  # op -> count

    def run(self) -> int:
        """Replays until the leader's stop (0)."""
        while True:
            op, *args = self.inbox.get()
            if op == "stop":
                logger.info("the leader stopped: exiting after launching %s",
                            dict(self.launches) or "nothing")
                return 0
            self.launches[op] += 1
            getattr(self, f"_{op}")(*args)

    def _forward(self, index: int, host: tuple, prev_index: int) -> None:
        prepared = self.runner.prepare_packed(*host)
        launched = self.runner.launch_forward(prepared, self.pendings.get(prev_index))
        if launched.index != index:
            raise RuntimeError(f"out of step with the leader: forward {launched.index} here, "
                               f"{index} there")
        self.forwards[index] = launched

    def _sample(self, forward_index: int, key: tuple, metadata: Any) -> None:
        pending = self.runner.launch_sampler_packed(self.forwards.pop(forward_index), key,
                                                    metadata)
        self.pendings[pending.index] = pending
        self.pendings.pop(pending.index - 2, None)  # a forward reads the sampler just before

    def _copy_blocks(self, src, dst) -> None:
        self.runner.copy_blocks(src, dst)

    def _compile(self, kind: str, args: tuple) -> None:
        # Compiled as the leader compiles it: a collective's first launch waits for every
        # process (gloo gives up after 30 s), so no node may start compiling only then.
        getattr(self.runner, f"_{kind}_executable")(*args)


def run_worker(config: EngineConfig) -> int:
    """A worker node (``jaxllm serve --headless --node-rank R``): builds the engine as the
    leader does, then replays the leader's steps until it stops (0); exits 1 when the leader
    is gone."""
    from jaxllm.engine.llm_engine import LLMEngine

    if config.node_rank == 0:
        raise ValueError("node rank 0 is the leader: it runs the server, not the worker loop")
    try:
        engine = LLMEngine(config, progress=False)
        logger.info("node %d ready: replaying the leader's steps", config.node_rank)
        return StepReplayer(engine.runner, engine.nodes.inbox).run()
    except BaseException as e:
        if not jax.distributed.is_initialized():
            raise  # it never joined: an ordinary error (e.g. no coordinator to reach)
        # Exiting normally would wait in JAX's shutdown barrier for a leader that waits in
        # a collective for this node: end now, so that the leader sees this node gone.
        logger.exception("node %d failed", config.node_rank)
        exit_now(EXIT_PEER_LOST, "node %d failed (%r): exiting", config.node_rank, e)
        raise  # not reached
