"""Multi-host serving on one machine: two CPU processes joined by ``jax.distributed`` (gloo
collectives), one device each, serve a tensor-parallel-2 (and a pipeline-parallel-2) model
with the tokens one process with two devices gives; a worker's death ends the leader (exit 1,
never a hang), the leader's death ends its workers, and a worker with no leader to reach fails
within its time-out with a message naming the flags. The flags and LeaderWorkerSet's
environment, without processes.

Every node runs in its own process (``tests/multidevice/multihost_node.py`` or ``jaxllm
serve``), on free ports, with a time-out, and is killed if still alive at the end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from jaxllm.serve.args import build_parser, configs_from_args

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NODE = os.path.join(HERE, "multidevice", "multihost_node.py")
TINY = os.path.join(HERE, "fixtures", "tiny", "llama3_rope_scaling")
BOUND = 20.0  # seconds a peer's death may take to end a node (it is usually well under 1)


# ------------------------------------------------------------------ flags, no processes
def configs(argv: list[str], environ: dict | None = None):
    return configs_from_args(build_parser().parse_args(argv), environ or {})


def test_node_flags_and_leaderworkerset_environment():
    engine, server = configs(["--nnodes", "2", "--node-rank", "1", "--headless",
                              "--master-addr", "10.0.0.5", "--master-port", "7000", "-tp", "16"])
    assert (engine.nnodes, engine.node_rank, engine.master_addr, engine.master_port) == \
        (2, 1, "10.0.0.5", 7000) and server.headless
    lws = {"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "3",
           "LWS_LEADER_ADDRESS": "vllm-0.vllm.default"}
    engine, server = configs(["--headless"], lws)
    assert (engine.nnodes, engine.node_rank, engine.master_addr) == \
        (4, 3, "vllm-0.vllm.default") and server.headless
    engine, server = configs(["--node-rank", "0"], lws)  # flags win over the environment
    assert (engine.nnodes, engine.node_rank) == (4, 0) and not server.headless
    engine, _ = configs([])
    assert (engine.nnodes, engine.node_rank, engine.master_addr, engine.master_port) == \
        (1, 0, "127.0.0.1", 29501)


@pytest.mark.parametrize("argv, environ, message", [
    (["--nnodes", "2", "--node-rank", "1"], {}, "add --headless"),
    (["--nnodes", "2", "--headless"], {}, "node 0 runs the API server"),
    (["--nnodes", "2", "--node-rank", "2", "--headless"], {}, "--node-rank=2 must be in"),
    (["--nnodes", "2", "-dp", "2"], {}, "--data-parallel-size=2 with --nnodes=2"),
    (["--headless"], {"LWS_GROUP_SIZE": "two", "LWS_WORKER_INDEX": "1"}, "LWS_GROUP_SIZE='two'"),
    (["--nnodes", "2", "--preemption-mode", "swap"], {}, "not supported with nnodes > 1"),
])
def test_node_flags_refused_with_a_message_naming_them(argv, environ, message):
    with pytest.raises(ValueError, match=message):
        configs(argv, environ)


# ------------------------------------------------------------------------ processes
def free_port_pair() -> int:
    """A free port whose successor is free too (the coordinator and the step channel)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65534:
            with contextlib.suppress(OSError), socket.socket() as t:
                t.bind(("127.0.0.1", port + 1))
                return port
    raise RuntimeError("no two consecutive free ports")


class Node:
    """A node's process, its output collected on a thread."""

    def __init__(self, argv: list[str], devices: int = 1, **env: str):
        environment = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
                           JAXLLM_DISTRIBUTED_INIT_TIMEOUT="90", PYTHONUNBUFFERED="1")
        environment.update(env)
        environment.pop("XLA_FLAGS", None)  # no forced host device count from the parent
        self.process = subprocess.Popen(argv, cwd=ROOT, env=environment, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            if self.process.poll() is not None:
                time.sleep(0.2)  # the last lines
                if any(text in line for line in self.lines):
                    return next(line for line in self.lines if text in line)
                break
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {timeout} s (exit "
                             f"{self.process.poll()}):\n{self.output[-3000:]}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n"
                                 f"{self.output[-3000:]}") from None
        # The process is gone but its last lines may still be in the pipe: the reader ends
        # at EOF (a test once read the output before the exit message reached self.lines).
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


@contextlib.contextmanager
def nodes(*started: Node):
    try:
        yield started
    finally:
        for node in started:
            node.kill()


def node_argv(rank: int, nnodes: int, port: int, *extra: str) -> list[str]:
    return [sys.executable, NODE, "--nnodes", str(nnodes), "--node-rank", str(rank),
            "--port", str(port), *extra]


def tokens(node: Node, timeout: float) -> list:
    return json.loads(node.wait_for("TOKENS ", timeout).split(" ", 1)[1])


def test_two_nodes_give_one_process_tokens_and_a_dead_leader_ends_its_worker():
    port = free_port_pair()
    with nodes(Node(node_argv(0, 1, port), devices=2),  # the reference: TP 2 in one process
               Node(node_argv(0, 2, port, "--keep-going")),
               Node(node_argv(1, 2, port))) as (reference, leader, worker):
        expected = tokens(reference, 180)
        assert tokens(leader, 180) == expected
        leader.wait_for("BUSY", 30)
        time.sleep(0.5)  # mid-generation: the worker is in the step's collectives
        leader.kill()
        start = time.monotonic()
        assert worker.wait(BOUND) == 1, worker.output[-3000:]
        assert time.monotonic() - start < BOUND
        assert "the leader (node 0) is gone" in worker.output
        assert reference.wait(30) == 0


def test_two_nodes_pipeline_parallel_give_one_process_tokens():
    """PP 2 across two processes (one layer stage each, activations passed between processes)
    gives the tokens of PP 2 in one process with two devices; both nodes then exit 0."""
    port = free_port_pair()
    pp2 = ("--tp", "1", "--pp", "2")
    with nodes(Node(node_argv(0, 1, port, *pp2), devices=2),
               Node(node_argv(0, 2, port, *pp2)),
               Node(node_argv(1, 2, port, *pp2))) as (reference, leader, worker):
        assert tokens(leader, 180) == tokens(reference, 180)
        assert leader.wait(60) == 0, leader.output[-3000:]
        assert worker.wait(BOUND) == 0, worker.output[-3000:]
        assert reference.wait(30) == 0


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def serve_argv(http_port: int, master_port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxllm.serve", TINY, "--port", str(http_port),
            "--host", "127.0.0.1", "--master-port", str(master_port), "-pp", "2",
            "--enforce-eager", "--max-model-len", "64", "--max-num-seqs", "4",
            "--num-gpu-blocks-override", "32", *extra]


def test_serve_on_two_nodes_then_a_dead_worker_ends_the_server():
    """``jaxllm serve`` as node 0 and ``jaxllm serve --headless`` as node 1 (LWS's environment
    gives the worker its rank), pipeline parallel across the two; the worker is killed: the
    engine core exits, the server reports the engine dead and exits 1 within seconds."""
    port, http = free_port_pair(), free_port_pair()
    lws = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "127.0.0.1"}
    with nodes(Node(serve_argv(http, port, "--nnodes", "2", "--node-rank", "0")),
               Node(serve_argv(http, port, "--headless"), **lws)) as (leader, worker):
        health = f"http://127.0.0.1:{http}/health"
        deadline = time.monotonic() + 120
        while http_status(health) != 200:
            assert time.monotonic() < deadline and leader.process.poll() is None, \
                leader.output[-3000:] + worker.output[-3000:]
            time.sleep(0.2)
        worker.wait_for("replaying the leader's steps", 30)
        worker.kill()
        start = time.monotonic()
        assert leader.wait(BOUND) == 1, leader.output[-3000:]
        assert time.monotonic() - start < BOUND
        assert "worker node 1 is gone" in leader.output


def test_a_worker_without_a_leader_fails_in_time_with_a_clear_message():
    port = free_port_pair()
    with nodes(Node(node_argv(1, 2, port), JAXLLM_DISTRIBUTED_INIT_TIMEOUT="2")) as (worker,):
        start = time.monotonic()
        assert worker.wait(60) != 0
        assert time.monotonic() - start < 60
        assert f"could not reach the JAX coordinator at 127.0.0.1:{port}" in worker.output
        assert "--master-addr and --master-port" in worker.output
