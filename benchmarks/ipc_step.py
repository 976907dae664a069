"""``python -m jaxllm.benchmarks.ipc_step``: what the engine-core process boundary costs a step.

R running requests each get one new token a step (a streamed decode step, delta outputs; the
prompt ids, and with ``deltas`` the metrics, travel with a request's first output only). The
engine side turns the step's filled tokens into what the core sends, pickles it and sends it
the way the engine core does
(``jaxllm.engine.core_process``: a ZMQ ROUTER to a DEALER over ``ipc://``); a receiving
process unpickles it and makes the RequestOutputs a server reads; it acknowledges each step.
Two formats:

- ``deltas`` (today): the core sends token ids (``request_outputs.core_output``) and the
  receiver detokenizes and applies stop strings (``RequestOutputProcessor``), as a front end.
- ``text`` (before issue 17's change): the engine thread detokenized
  (``OutputProcessor.detokenize``), built RequestOutputs and sent them with their text as
  tuples; the receiver only rebuilt the dataclasses.

With ``--tokenizer`` (a tokenizer.json, HF directory or .gguf) the tokens are a real text's
and detokenizing costs what it costs; without one nothing is detokenized. Printed per step,
medians over ``--steps``: the engine thread's cost (outputs, encode, pickle, send: what was
``output_seconds`` plus the send), the receiver's (unpickle, outputs), and the round trip;
the first two also as CPU time of the thread (``time.thread_time``), which other processes on
a shared host do not inflate as they do the wall time.

    python -m jaxllm.benchmarks.ipc_step --rows 64,256,1024 \\
        --tokenizer .gpu_deps/smollm2_tokenizer.json --output-json ipc.json
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
from types import SimpleNamespace

import numpy as np
import zmq

from jaxllm.engine.core_process import dumps
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.outputs import CompletionOutput, RequestOutput
from jaxllm.engine.request_outputs import RequestOutputProcessor, core_output
from jaxllm.engine.sequence import (
    PLACEHOLDER_TOKEN,
    RequestMetrics,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

PROMPT_LEN = 16
TEXT = ("The engine core runs the step loop in its own process; the front ends tokenize, "
        "detokenize and stream. A stop string found in a front end ends the request there "
        "and stops it in the core, which frees its blocks. ") * 8
PARAMS = SamplingParams(max_tokens=1 << 20, output_kind=RequestOutputKind.DELTA)


def request_id(row: int) -> str:
    return f"cmpl-{row:032x}-0"


def token_stream(tokenizer) -> list[int]:
    """The ids each request draws from, in turn (each row starts at its own offset)."""
    if tokenizer is None:
        return list(range(1000, 1512))
    return list(tokenizer(TEXT, add_special_tokens=False)["input_ids"])


def load(path: str | None):
    if path is None:
        return None
    from jaxllm.loading.tokenizer import load_tokenizer

    return load_tokenizer(path)


# ---------------------------------------------------------------- engine side
class EngineSide:
    """R running requests in the engine, each given one token a step as ``_record`` does."""

    def __init__(self, rows: int, wire_format: str, tokenizer):
        self.format = wire_format
        self.stream = token_stream(tokenizer)
        self.processor = OutputProcessor(tokenizer if wire_format == "text" else None, (),
                                         lambda seq, status: setattr(seq, "status", status))
        self.groups = []
        for r in range(rows):
            seq = Sequence(r, self.stream[r:r + PROMPT_LEN])
            seq.status = SequenceStatus.RUNNING
            group = SequenceGroup(request_id(r), [seq], PARAMS)
            self.processor.attach_detokenizer(seq, PARAMS)
            self.groups.append(group)

    def fill(self, step: int) -> None:
        """The step's tokens into their sequences (the update phase: not timed)."""
        n = len(self.stream)
        sampled = np.array([self.stream[(r + PROMPT_LEN + step) % n]
                            for r in range(len(self.groups))])
        result = SimpleNamespace(sampled=sampled, logprob=np.zeros(len(self.groups)))
        for r, group in enumerate(self.groups):
            seq = group.seqs[0]
            seq.token_ids.append(PLACEHOLDER_TOKEN)
            seq.pending[seq.num_tokens - 1] = r
            self.processor.fill_token(seq, group, result, r, seq.num_tokens - 1)

    def outputs(self, step: int) -> list:
        """What the engine thread sends for the step (timed)."""
        touched = self.processor.detokenize()
        if self.format == "deltas":
            items = [core_output(g, None) for g in touched]
            return items if step == 0 else [(i[0], None, None, i[3], None, i[5]) for i in items]
        outputs = [RequestOutput.from_group(g, None) for g in touched]
        if step:
            for o in outputs:
                o.prompt_token_ids = None
        return encode_text(outputs)


def encode_text(outputs: list[RequestOutput]) -> list[tuple]:
    """The wire format before issue 17's change: RequestOutputs with their text, as tuples."""
    encoded = []
    for o in outputs:
        m = o.metrics
        encoded.append((o.request_id, o.prompt, o.prompt_token_ids, o.finished,
                        o.num_cached_tokens,
                        (m.arrival_time, m.first_scheduled_time, m.first_token_time,
                         m.finished_time, m.num_cached_tokens),
                        [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs,
                          c.finish_reason, c.stop_reason) for c in o.outputs]))
    return encoded


def decode_text(item: tuple) -> RequestOutput:
    request_id, prompt, prompt_ids, finished, cached, metrics, outputs = item
    return RequestOutput(request_id, prompt, prompt_ids or [],
                         [CompletionOutput(*c) for c in outputs], finished,
                         RequestMetrics(*metrics), cached)


# ---------------------------------------------------------------- front-end side
def receiver(address: str, wire_format: str, rows: int, tokenizer_path: str | None) -> None:
    processor = None
    if wire_format == "deltas":
        processor = RequestOutputProcessor(load(tokenizer_path))
        for r in range(rows):
            processor.add_request(request_id(r), None, None, PARAMS)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, b"fe0")
    socket.connect(address)
    socket.send(b"hello")
    spent, cpu = [], []
    while True:
        payload = socket.recv()
        start, start_cpu = time.perf_counter(), time.thread_time()
        message = pickle.loads(payload)
        if message[0] == "done":
            socket.send(pickle.dumps((spent, cpu)))
            return
        if processor is not None:
            outputs, _ = processor.process(message[1])
        else:
            outputs = [decode_text(item) for item in message[1]]
        assert len(outputs) == len(message[1])
        spent.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
        socket.send(b"ack")


# ---------------------------------------------------------------- the run
def run(args) -> dict:
    results = {"rows": {}, "tokenizer": args.tokenizer}
    tokenizer = load(args.tokenizer)
    for wire_format in args.formats.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            results["rows"][f"{wire_format} {rows}"] = measure(args, wire_format, rows,
                                                               tokenizer)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results | {"date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                 "steps": args.steps}, f, indent=1)
    return results


def measure(args, wire_format: str, rows: int, tokenizer) -> dict:
    if wire_format not in ("deltas", "text"):
        raise ValueError(f"--formats: {wire_format!r} is not one of deltas, text")
    directory = tempfile.mkdtemp(prefix="jaxllm-ipc-")
    address = f"ipc://{os.path.join(directory, 'bench.sock')}"
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.bind(address)
    proc = multiprocessing.get_context("spawn").Process(
        target=receiver, args=(address, wire_format, rows, args.tokenizer), daemon=True)
    proc.start()
    identity, _ = socket.recv_multipart()
    engine = EngineSide(rows, wire_format, tokenizer)
    send_s, send_cpu, round_trip_s, sizes = [], [], [], []
    for step in range(args.steps + args.warmup):
        engine.fill(step)
        start, start_cpu = time.perf_counter(), time.thread_time()
        frame = dumps(("outputs", engine.outputs(step)))
        socket.send_multipart([identity, frame], copy=False)
        sent, sent_cpu = time.perf_counter(), time.thread_time()
        socket.recv_multipart()
        if step >= args.warmup:
            send_s.append(sent - start)
            send_cpu.append(sent_cpu - start_cpu)
            round_trip_s.append(time.perf_counter() - start)
            sizes.append(len(frame))
    socket.send_multipart([identity, pickle.dumps(("done",))])
    receive_s, receive_cpu = (x[args.warmup:] for x in pickle.loads(socket.recv_multipart()[1]))
    proc.join(10)
    socket.close(0)
    context.term()
    row = {"send_ms": 1e3 * statistics.median(send_s),
           "send_cpu_ms": 1e3 * statistics.median(send_cpu),
           "receive_ms": 1e3 * statistics.median(receive_s),
           "receive_cpu_ms": 1e3 * statistics.median(receive_cpu),
           "round_trip_ms": 1e3 * statistics.median(round_trip_s),
           "bytes": statistics.median(sizes)}
    print(f"{wire_format:6s} rows {rows:5d}: engine thread {row['send_ms']:.3f} ms "
          f"({row['send_cpu_ms']:.3f} CPU), receiver {row['receive_ms']:.3f} ms "
          f"({row['receive_cpu_ms']:.3f} CPU), round trip {row['round_trip_ms']:.3f} ms, "
          f"{row['bytes'] / 1024:.1f} KiB a step")
    return row


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="64,256,1024")
    parser.add_argument("--formats", default="deltas,text", help="deltas, text")
    parser.add_argument("--tokenizer", default=None,
                        help="detokenize with this tokenizer (tokenizer.json, HF dir, .gguf)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--output-json", default=None)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p)
    run(p.parse_args(sys.argv[1:]))
