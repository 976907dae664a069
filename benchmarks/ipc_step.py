"""``python -m jaxllm.benchmarks.ipc_step``: what the engine-core process boundary costs a step.

A step's outputs for R running requests (delta outputs: one new token and its text each, as a
streamed step carries; the prompt ids travel with a request's first output only) are sent
the way the engine core sends them (``jaxllm.engine.core_process``: pickled, a ZMQ ROUTER to a
DEALER over ``ipc://``) to a receiving process that unpickles them, and acknowledged. Printed
per step, medians over ``--steps``: the sender's cost on the engine's thread (encode, pickle,
send), the receiver's (unpickle, decode), and the round trip (send to acknowledgement).

    python -m jaxllm.benchmarks.ipc_step --rows 64,256,1024 --output-json ipc.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import statistics
import sys
import tempfile
import time

import zmq

from jaxllm.engine.core_process import decode_output, dumps, encode_outputs
from jaxllm.engine.outputs import CompletionOutput, RequestOutput
from jaxllm.engine.sequence import RequestMetrics


def step_outputs(rows: int, step: int) -> list[RequestOutput]:
    now = time.monotonic()
    return [RequestOutput(f"cmpl-{r:032x}-0", None, None, [CompletionOutput(
        0, " tok", [1000 + step], None, None)], False, RequestMetrics(now, now, now), 0)
            for r in range(rows)]


# How a step's outputs go on the wire: as the engine core sends them, or the dataclasses
# pickled as they are (what it sent before; kept to measure the two side by side).
FORMATS = {"tuples": (encode_outputs, decode_output), "dataclasses": (list, lambda item: item)}


def receiver(address: str, wire_format: str) -> None:
    decode = FORMATS[wire_format][1]
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, b"fe0")
    socket.connect(address)
    socket.send(b"hello")
    spent = []
    while True:
        payload = socket.recv()
        start = time.perf_counter()
        message = pickle.loads(payload)
        if message[0] == "stop":
            socket.send(pickle.dumps(spent))
            return
        outputs = [decode(item) for item in message[1]]
        assert len(outputs) == len(message[1])
        spent.append(time.perf_counter() - start)
        socket.send(b"ack")


def run(args) -> dict:
    results = {"rows": {}}
    for wire_format in args.formats.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            results["rows"][f"{wire_format} {rows}"] = measure(args, wire_format, rows)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results | {"date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                 "steps": args.steps}, f, indent=1)
    return results


def measure(args, wire_format: str, rows: int) -> dict:
    encode = FORMATS[wire_format][0]
    directory = tempfile.mkdtemp(prefix="jaxllm-ipc-")
    address = f"ipc://{os.path.join(directory, 'bench.sock')}"
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.bind(address)
    proc = multiprocessing.get_context("spawn").Process(target=receiver,
                                                        args=(address, wire_format))
    proc.start()
    identity, _ = socket.recv_multipart()
    send_s, round_trip_s, sizes = [], [], []
    for step in range(args.steps + args.warmup):
        outputs = step_outputs(rows, step)
        start = time.perf_counter()
        frame = dumps(("outputs", encode(outputs)))
        socket.send_multipart([identity, frame], copy=False)
        sent = time.perf_counter()
        socket.recv_multipart()
        if step >= args.warmup:
            send_s.append(sent - start)
            round_trip_s.append(time.perf_counter() - start)
            sizes.append(len(frame))
    socket.send_multipart([identity, pickle.dumps(("stop",))])
    receive_s = pickle.loads(socket.recv_multipart()[1])[args.warmup:]
    proc.join(10)
    socket.close(0)
    context.term()
    row = {"send_ms": 1e3 * statistics.median(send_s),
           "receive_ms": 1e3 * statistics.median(receive_s),
           "round_trip_ms": 1e3 * statistics.median(round_trip_s),
           "bytes": statistics.median(sizes)}
    print(f"{wire_format:11s} rows {rows:5d}: sender {row['send_ms']:.3f} ms, receiver "
          f"{row['receive_ms']:.3f} ms, round trip {row['round_trip_ms']:.3f} ms, "
          f"{row['bytes'] / 1024:.1f} KiB a step")
    return row


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="64,256,1024")
    parser.add_argument("--formats", default="tuples,dataclasses", help=", ".join(FORMATS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--output-json", default=None)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p)
    run(p.parse_args(sys.argv[1:]))
