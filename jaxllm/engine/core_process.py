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
                                                              engine_core.LOAD_INTERVAL while busy
                                                              and once on going idle (load
                                                              balancing)

Why ZMQ: its I/O threads do the socket writes, so the engine loop's send of a step's outputs is
a queue push, and a slow front end never blocks the loop (high-water marks are off: an output
is never dropped). Why pickle: the payloads are the engine's own types, and no schema has to
be kept beside them. A step's outputs travel as plain tuples of new token ids
(:func:`jaxllm.engine.request_outputs.core_output`): pickling RequestOutput dataclasses cost 3x
more on the engine's thread and 7x more to read (``benchmarks/ipc_step.py``, RESULTS), and a
request's prompt and prompt ids travel with its first output only (the client keeps them).
The core does not detokenize: each front end turns its requests' tokens into text and
applies stop strings (:class:`jaxllm.engine.request_outputs.RequestOutputProcessor`), and
sends "stop" for a sample a stop string ended, so that the core frees its blocks. The
process's inside (its entry point and loop) is :mod:`jaxllm.engine.engine_core`.
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
import tempfile
from typing import Any

from jaxllm.engine.engine_client import EngineInfo
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.replica_devices import replica_device_env

logger = logging.getLogger(__name__)
PICKLE = pickle.HIGHEST_PROTOCOL


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
    from jaxllm.engine.engine_core import run_engine_core  # (it imports this module)

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
