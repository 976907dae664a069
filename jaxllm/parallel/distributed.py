"""Several processes, one a host, joined into one JAX runtime with ``jax.distributed``.

Each process calls :func:`initialize` before any JAX computation, with the coordinator's
address (the leader's ``--master-addr``:``--master-port``; process 0 runs the coordinator's
gRPC service there), the process count (``--nnodes``) and its id (``--node-rank``). Afterwards
``jax.devices()`` lists every process's devices and the mesh
(:func:`jaxllm.parallel.make_mesh`) spans them; XLA runs the collectives across hosts (NCCL on
GPUs, gloo over TCP on CPU).

The device rule (vLLM's: TP x PP = the world size): across nodes the model spans every device
of every node, so ``--tensor-parallel-size`` x ``--pipeline-parallel-size`` must equal
``--nnodes`` x the devices of one node, and every node must have as many devices
(:func:`check_node_devices`). E.g. two hosts of 8 GPUs: ``-tp 16``, or ``-tp 8 -pp 2``.

Start-up is bounded: a worker first waits (up to ``JAXLLM_DISTRIBUTED_INIT_TIMEOUT`` seconds,
default 300 as JAX's) for the coordinator's port to accept a connection, and otherwise fails
with a message naming the address and the flags; JAX's own timeout would abort the process
with a gRPC ``DEADLINE_EXCEEDED`` that says neither.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import jax
import numpy as np

from jaxllm.errors import JaxLLMError

logger = logging.getLogger(__name__)
INIT_TIMEOUT_ENV = "JAXLLM_DISTRIBUTED_INIT_TIMEOUT"
DEFAULT_INIT_TIMEOUT = 300.0  # seconds, as jax.distributed.initialize's default
# Seconds without a heartbeat after which JAX's coordination service declares a process dead
# and aborts the others: the backstop behind the engine's own lifelines (which see a dead
# process's closed sockets at once), kept short so a vanished host never stalls a node for
# JAX's default 100 s.
HEARTBEAT_TIMEOUT = 30


class DistributedInitError(JaxLLMError):
    """A process could not join the others (coordinator unreachable, devices that do not fit
    the parallel sizes); the message says which flag to check."""


def init_timeout(environ: dict | None = None) -> float:
    environ = os.environ if environ is None else environ
    value = environ.get(INIT_TIMEOUT_ENV, "")
    try:
        timeout = float(value) if value else DEFAULT_INIT_TIMEOUT
    except ValueError:
        raise DistributedInitError(f"{INIT_TIMEOUT_ENV}={value!r} must be a number of "
                                   "seconds") from None
    if timeout <= 0:
        raise DistributedInitError(f"{INIT_TIMEOUT_ENV}={value!r} must be > 0 seconds")
    return timeout


def wait_for_port(host: str, port: int, deadline: float, what: str) -> None:
    """Returns once ``host:port`` accepts a TCP connection; raises DistributedInitError
    naming ``what`` at ``deadline`` (time.monotonic())."""
    error: Exception | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as e:
            error = e
        if time.monotonic() >= deadline:
            raise DistributedInitError(f"could not reach {what} at {host}:{port} ({error})")
        time.sleep(0.25)


def initialize(master_addr: str, master_port: int, nnodes: int, node_rank: int,
               timeout: float | None = None) -> None:
    """Joins this process to the others (``jax.distributed.initialize``); must run before
    any JAX computation. Idempotent for the same arguments."""
    coordinator = f"{master_addr}:{master_port}"
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (nnodes, node_rank):
            raise DistributedInitError(
                f"this process already joined as node {jax.process_index()} of "
                f"{jax.process_count()}; cannot join again as --node-rank {node_rank} of "
                f"--nnodes {nnodes}")
        return
    timeout = init_timeout() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    if node_rank > 0:
        try:
            wait_for_port(master_addr, master_port, deadline, "the JAX coordinator")
        except DistributedInitError as e:
            raise DistributedInitError(
                f"--node-rank {node_rank}: {e} within {timeout:.0f} s: start the leader "
                "(--node-rank 0) with the same --master-addr and --master-port, check that "
                f"this host can reach it, or raise {INIT_TIMEOUT_ENV}") from None
    else:
        logger.info("node 0 of %d: starting the JAX coordinator on port %d; waiting up to "
                    "%.0f s for the other nodes to join", nnodes, master_port, timeout)
    try:
        jax.distributed.initialize(
            coordinator, num_processes=nnodes, process_id=node_rank,
            cluster_detection_method="deactivate",  # the flags say it all (LWS: not detected)
            initialization_timeout=max(1, int(deadline - time.monotonic())),
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT)
    except RuntimeError as e:  # e.g. JAX already ran a computation in this process
        raise DistributedInitError(
            f"--nnodes {nnodes}: this process cannot join the others ({e}); a multi-node "
            "engine must be the first thing to use JAX in its process (pass the model by "
            "name, not loaded)") from None
    logger.info("node %d of %d joined the JAX runtime at %s: %d local of %d devices",
                node_rank, nnodes, coordinator, jax.local_device_count(), jax.device_count())


def check_node_devices(tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
    """The device rule of the module docstring; raises DistributedInitError naming the
    flags."""
    nnodes, total = jax.process_count(), jax.device_count()
    per_node = np.bincount([d.process_index for d in jax.devices()], minlength=nnodes)
    if len(set(per_node.tolist())) != 1:
        raise DistributedInitError(
            f"every node must have the same number of devices; they have "
            f"{per_node.tolist()} (set JAX_NUM_CPU_DEVICES or CUDA_VISIBLE_DEVICES alike)")
    used = tensor_parallel_size * pipeline_parallel_size
    if used != total:
        raise DistributedInitError(
            f"--tensor-parallel-size {tensor_parallel_size} x --pipeline-parallel-size "
            f"{pipeline_parallel_size} = {used}: with --nnodes {nnodes} it must equal the "
            f"devices of all nodes ({nnodes} x {per_node[0]} = {total}), as vLLM's TP x PP = "
            "world size")


def agree_min(value: int) -> int:
    """The smallest of every process's ``value`` (e.g. the KV blocks each node's memory
    allows), so that all of them allocate the same global arrays."""
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def put_from_host(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)`` for host (numpy) values that every process holds
    alike: each process makes only its own devices' shards. ``device_put`` itself would first
    check across processes that the values are equal, a collective per call (and a hang when
    only one process makes it)."""
    def put(sharding, subtree):
        return jax.tree.map(lambda x: jax.make_array_from_callback(
            np.shape(x), sharding, lambda index: np.asarray(x)[index]), subtree)

    # ``shardings`` may be a prefix of ``tree`` (one sharding for a whole dataclass), as
    # device_put allows.
    return jax.tree.map(put, shardings, tree,
                        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
