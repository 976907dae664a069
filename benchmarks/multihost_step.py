"""``python -m jaxllm.benchmarks.multihost_step``: what sending a step's inputs from the leader
to a worker costs (multi-host serving, ``jaxllm.engine.multihost``).

A decode step of R rows is what the leader's ModelRunner sends every step: the forward's
packed batch (``BatchMetadata``, numpy; block tables ``--table-width`` wide) and the sampler's
metadata (``SamplingMetadata``), as the two messages ``("forward", ...)`` and
``("sample", ...)``. Per step, medians over ``--steps``:

- ``side channel`` (what jaxllm does): the leader pickles and sends both messages over a
  localhost TCP connection (``multihost.frame`` + ``sendall``: the cost on the leader's step
  path), a worker process reads and unpickles them (as ``multihost.read_message``) and
  acknowledges; the leader's cost, the worker's unpickling, and the round trip (leader's
  send to the worker's acknowledgement).
- ``broadcast_one_to_all`` (``--compare-broadcast``, the alternative): two processes joined
  by ``jax.distributed`` (one CPU device each, gloo) broadcast the same pytree from process 0
  with ``jax.experimental.multihost_utils.broadcast_one_to_all``: a device collective, on
  every node's step path.

    python -m jaxllm.benchmarks.multihost_step --rows 8,64,256 --compare-broadcast \\
        --output-json /tmp/multihost_step.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from jaxllm.batch import SeqChunks, pack_batch
from jaxllm.engine.buckets import StepShape
from jaxllm.engine.multihost import _HEADER, _read_exact, frame
from jaxllm.sampler_rows import SamplerInput, build_sampling_metadata
from jaxllm.sampling_params import SamplingParams

BLOCK_SIZE = 16
BANNED_WIDTH = 8


def step_messages(rows: int, table_width: int, index: int = 0) -> tuple[tuple, tuple]:
    """A decode step of ``rows`` sequences as the leader's runner sends it: half greedy, half
    sampled with top-k/top-p."""
    rng = np.random.default_rng(rows)
    computed = rng.integers(64, table_width * BLOCK_SIZE - 1, rows).astype(np.int32)
    tables = np.zeros((rows, table_width), np.int32)
    for i, n in enumerate(computed):
        used = -(-(int(n) + 1) // BLOCK_SIZE)
        tables[i, :used] = rng.integers(1, 1 << 15, used)
    chunks = SeqChunks(rng.integers(0, 32000, rows).astype(np.int32),
                       np.ones(rows, np.int32), computed, tables)
    batch = pack_batch(chunks, BLOCK_SIZE, num_tokens=rows, num_seqs=rows,
                       table_width=table_width, num_logits=rows, decode_only=True)
    prev_rows = np.arange(rows, dtype=np.int32)  # async scheduling: every token a placeholder
    shape = StepShape(rows, rows, table_width, True)
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8,
                                                                      top_p=0.95, top_k=50)
    inputs = [SamplerInput(greedy if i % 2 else sampled, seed=i, step=int(computed[i]) % 100)
              for i in range(rows)]
    md = build_sampling_metadata(inputs, rows, 0, BANNED_WIDTH)
    key = (rows, 0, "variant")
    return (("forward", index, (shape, False, batch, prev_rows), index - 1),
            ("sample", index, key, md))


# ------------------------------------------------------------------------ side channel
def _worker(port: int, steps: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(steps):
        payloads = []
        for _ in range(2):  # as multihost.read_message, the unpickling timed apart
            (size,) = _HEADER.unpack(_read_exact(sock, _HEADER.size))
            payloads.append(_read_exact(sock, size))
        start = time.perf_counter()
        for payload in payloads:
            pickle.loads(payload)
        times.append(time.perf_counter() - start)
        sock.sendall(b"k")
    sock.sendall(json.dumps(times).encode() + b"\n")
    sock.close()


def side_channel(rows: int, table_width: int, steps: int) -> dict:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    process = multiprocessing.get_context("spawn").Process(target=_worker, args=(port, steps))
    process.start()
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send, round_trip, size = [], [], 0
    for i in range(steps):
        forward, sample = step_messages(rows, table_width, i)
        start = time.perf_counter()
        a, b = frame(forward), frame(sample)
        sock.sendall(a)
        sock.sendall(b)
        sent = time.perf_counter()
        assert sock.recv(1) == b"k"
        send.append(sent - start)
        round_trip.append(time.perf_counter() - start)
        size = len(a) + len(b)
    buffer = b""
    while not buffer.endswith(b"\n"):
        buffer += sock.recv(1 << 16)
    receive = json.loads(buffer)
    process.join()
    sock.close()
    listener.close()
    return {"rows": rows, "bytes": size,
            "leader_us": 1e6 * statistics.median(send),
            "worker_unpickle_us": 1e6 * statistics.median(receive),
            "round_trip_us": 1e6 * statistics.median(round_trip)}


# -------------------------------------------------------------- broadcast_one_to_all
def _broadcast_node(rank: int, port: int, rows: int, table_width: int, steps: int) -> None:
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank,
                               cluster_detection_method="deactivate")
    from jax.experimental import multihost_utils

    forward, sample = step_messages(rows, table_width)
    tree = (forward[2][2], forward[2][3], sample[3])  # batch, prev_rows, sampling metadata
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        multihost_utils.broadcast_one_to_all(tree, is_source=rank == 0)
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps({"rows": rows, "broadcast_us": 1e6 * statistics.median(times[5:])}))


def broadcast(rows: int, table_width: int, steps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    code = (f"from jaxllm.benchmarks.multihost_step import _broadcast_node; "
            f"_broadcast_node({{rank}}, {port}, {rows}, {table_width}, {steps})")
    nodes = [subprocess.Popen([sys.executable, "-c", code.format(rank=r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for r in range(2)]
    out = [p.communicate(timeout=600)[0] for p in nodes]
    return json.loads(out[0].strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,64,256")
    parser.add_argument("--table-width", type=int, default=64,
                        help="block-table columns (64 x 16 = 1024-token contexts)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compare-broadcast", action="store_true")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    results = []
    for rows in map(int, args.rows.split(",")):
        result = side_channel(rows, args.table_width, args.steps)
        if args.compare_broadcast:
            result.update(broadcast(rows, args.table_width, min(args.steps, 100)))
        results.append(result)
        line = (f"rows {rows:4d}: {result['bytes']:7d} B/step; side channel: leader "
                f"{result['leader_us']:7.1f} us, worker unpickle "
                f"{result['worker_unpickle_us']:7.1f} us, round trip "
                f"{result['round_trip_us']:7.1f} us")
        if "broadcast_us" in result:
            line += f"; broadcast_one_to_all {result['broadcast_us']:8.1f} us"
        print(line, flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"table_width": args.table_width, "steps": args.steps,
                       "cpu_count": os.cpu_count(), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
