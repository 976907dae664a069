"""Schema fuzzing of a live ``jaxllm serve`` with schemathesis (issue 20's long run).

    python -m jaxllm.benchmarks.fuzz_server --examples 3000 --seconds-per-mode 75 \\
        --out fuzz.json

Starts a server of the embedded SmolLM2 model on 127.0.0.1 (``jaxllm serve`` in its own process:
benchmarks never import the server; with an API key),
sends a few warm-up requests (compiles, not counted), reads its ``/openapi.json`` and sends
every operation, four at a time, three kinds of cases: schemathesis' coverage cases (boundary
values, wrong types, missing fields, unexpected methods), then up to ``--examples``
hypothesis-drawn cases per mode from a fixed seed: positive (bodies the schema accepts) and
negative (bodies it refuses). Each response is checked (``fuzz_checks.check``): no 5xx and no
timeout, every non-2xx body an OpenAI error body with the status as its ``code``, a stream
ending in ``data: [DONE]``, no 2xx for a body the schema refuses, and schemathesis'
conformance checks (status code, content type, headers and body as documented). Afterwards
the server must still answer ``/health`` and a completion, with no request in the engine and
every KV block free. Prints and writes JSON: requests per operation and mode, the outcome
classes (``2xx``, each 4xx status, ``5xx:<status>``, ``timeout``), the problems found (the
first few of each kind, with the request to replay) and the final checks. Exit status 1 when
a problem was found.

Generation stays cheap on CPU: ``fuzz_checks.cap`` keeps ``max_tokens`` at ``MAX_TOKENS`` (set
when absent: chat would otherwise run to the context length) and ``n`` at 2, so the budget goes
to requests, not decode steps. tests/test_server_fuzz.py runs the same loop, bounded, in CI.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

import requests
from jaxllm.benchmarks import server_process
from jaxllm.benchmarks.fuzz_checks import (
    CONNECTION_FAILED,
    MAX_TOKENS,
    REQUEST_TIMEOUT,
    Tally,
    cap,
    check,
    replay,
)
from jaxllm.benchmarks.provenance import source_commit


def fuzz(base_url: str, headers: dict[str, str], examples: int, tally: Tally, *,
         modes: Iterable[str] = ("coverage", "positive", "negative"),
         paths: Iterable[str] | None = None, seed: int = 0, concurrency: int = 4,
         coverage_limit: int | None = None, seconds_per_mode: float | None = None) -> Tally:
    """Sends every operation of the server's schema (or those under ``paths``) ``examples``
    generated requests per mode, ``concurrency`` at a time (so the engine batches them).
    ``coverage_limit``: at most this many of an operation's coverage cases, evenly spread
    over them; ``seconds_per_mode``: stop sending an operation's positive or negative cases
    after this long (coverage cases are all sent)."""
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    local = threading.local()

    def send_one(case, label: str, mode: str) -> None:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        send(case, base_url, local.session, headers, tally, label, mode)

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for operation in (result.ok() for result in schema.get_all_operations()):
            if paths is not None and operation.path not in paths:
                continue
            label = f"{operation.method.upper()} {operation.path}"
            for mode in modes:
                began = time.monotonic()
                deadline = None if seconds_per_mode is None or mode == "coverage" else (
                    began + seconds_per_mode)
                in_flight: collections.deque = collections.deque()

                def submit(case, label=label, mode=mode, deadline=deadline,
                           in_flight=in_flight) -> bool:
                    """Sends ``case`` (a few ahead of the answers); False once time is up."""
                    if deadline is not None and time.monotonic() > deadline:
                        return False
                    in_flight.append(pool.submit(send_one, case, label, mode))
                    while len(in_flight) > 2 * concurrency:
                        in_flight.popleft().result()
                    return True

                if mode == "coverage":  # schemathesis' boundary and type cases, each once
                    cases = list(schema.iter_coverage_cases(
                        operation, generation_modes=list(GenerationMode),
                        generation_config=schema.config.generation_for(operation=operation)))
                    if coverage_limit is not None and len(cases) > coverage_limit:
                        cases = cases[::-(-len(cases) // coverage_limit)]
                    all(submit(case) for case in cases)
                else:
                    generate(operation.as_strategy(GenerationMode(mode)), examples, seed,
                             submit)
                for future in in_flight:
                    future.result()
                counts = tally.counts[f"{label} [{mode}]"]
                print(f"{label} [{mode}]: {sum(counts.values())} requests in "
                      f"{time.monotonic() - began:.1f} s: {dict(counts)}", file=sys.stderr,
                      flush=True)
    return tally


class _TimeUp(Exception):
    pass


def generate(strategy, examples: int, seed: int, take: Callable[[object], bool]) -> None:
    """Hands ``take`` up to ``examples`` cases drawn by hypothesis from ``seed`` (the same ones
    every run), until it returns False."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis.errors import Unsatisfiable

    @fixed_seed(seed)
    @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(case=strategy)
    def draw(case):
        if not take(case):
            raise _TimeUp

    try:
        draw()
    except (_TimeUp, Unsatisfiable):  # Unsatisfiable: nothing to generate (e.g. negative
        pass                          # data for a route without input)


def send(case, base_url: str, session: requests.Session, headers: dict[str, str],
         tally: Tally, label: str, mode: str) -> None:
    case.body = cap(case.operation.path, case.body)
    try:
        response = case.call(base_url=base_url, session=session, headers=headers,
                             timeout=REQUEST_TIMEOUT)
        status = response.status_code
    except requests.Timeout:
        response, status = None, None
    except requests.ConnectionError as e:  # the server went away (its engine died?)
        tally.record(label, mode, CONNECTION_FAILED, [f"no connection: {e}"[:200]],
                     lambda: replay(case))
        return
    problems = check(case, response, status)
    tally.record(label, mode, status, problems, lambda: replay(case))


def warm_up(base_url: str, headers: dict[str, str]) -> None:
    """Compiles the common step shapes before the clock of any mode starts: a few greedy and
    sampled completions and chats, four at a time (not counted)."""
    bodies = [{"prompt": "x " * length, "max_tokens": 2, "temperature": t, "logprobs": lp}
              for length in (1, 20, 100) for t in (0, 1) for lp in (None, 2)]
    bodies += [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": n,
                "temperature": 1} for n in (1, 2)]

    def post(body: dict) -> None:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        requests.post(base_url + path, headers=headers, json=body, timeout=REQUEST_TIMEOUT)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(post, bodies))


def final_checks(base_url: str, headers: dict[str, str], engine_state: Callable[[], dict]
                 ) -> dict:
    """The server still serves (health, a completion) and the engine is idle with every KV
    block free."""
    health = requests.get(base_url + "/health", timeout=30).status_code
    completion = requests.post(base_url + "/v1/completions", headers=headers, timeout=120, json={
        "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    deadline = time.monotonic() + 60
    state = engine_state()
    while state["unfinished"] and time.monotonic() < deadline:
        time.sleep(0.1)
        state = engine_state()
    return {"health": health, "completion": completion.status_code,
            "completion_text": completion.json()["choices"][0]["text"]
            if completion.status_code == 200 else None, **state,
            "ok": health == 200 and completion.status_code == 200 and not state["unfinished"]
            and state["free_blocks"] == state["usable_blocks"]}


def engine_state_reader(server) -> Callable[[], dict]:
    """Reads (on the engine thread) whether requests remain and how many blocks are free."""
    def read(engine):
        bm = engine.block_manager
        bm.check_invariants()
        return {"unfinished": engine.has_unfinished_requests(),
                "free_blocks": bm.num_free_blocks, "usable_blocks": bm.num_gpu_blocks - 1,
                "server_active": len(server.state.active),
                "admission_pending": server.state.admission.pending}

    return lambda: server.call(lambda: server.engine.run_in_engine(read))


# The limits of the tests' shared SmolLM2 engine (tests/conftest.py SMOLLM2_ENGINE_ARGS).
ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                   num_gpu_blocks_override=129, enforce_eager=True)
API_KEY = "fuzz-key"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--examples", type=int, default=2000,
                   help="generated requests per operation and mode (default 2000)")
    p.add_argument("--modes", default="coverage,positive,negative",
                   help="coverage (schemathesis' boundary cases), positive, negative")
    p.add_argument("--paths", default=None, help="comma-separated paths (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--seconds-per-mode", type=float, default=None,
                   help="stop sending an operation's positive or negative cases after this "
                        "long")
    p.add_argument("--coverage-limit", type=int, default=None,
                   help="at most this many coverage cases per operation (default: all)")
    p.add_argument("--out", default=None, help="write the JSON result here too")


def metrics_state_reader(base_url: str) -> Callable[[], dict]:
    """The engine's state as a server in another process reports it (``/metrics``)."""
    def read() -> dict:
        text = requests.get(base_url + "/metrics", timeout=30).text
        value = {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
                 for line in text.splitlines() if line.startswith("jaxllm:")}
        return {"unfinished": value["jaxllm:num_requests_running"]
                + value["jaxllm:num_requests_waiting"] > 0,
                "free_blocks": int(value["jaxllm:num_free_gpu_blocks"]),
                "usable_blocks": ENGINE_ARGS["num_gpu_blocks_override"] - 1}

    return read


def start_server(port: int) -> subprocess.Popen:
    """``jaxllm serve`` of the embedded model in its own process, with the tests' engine
    limits; returns once it answers /health."""
    flags = [f"--{name.replace('_', '-')}" + ("" if value is True else f"={value}")
             for name, value in ENGINE_ARGS.items()]
    return server_process.start_server(port, [
        "--dtype", "float32", "--api-key", API_KEY, "--served-model-name", "smollm2", "alias",
        "--disable-log-stats", *flags])


def run(args: argparse.Namespace) -> int:
    port = server_process.free_port()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    started = time.monotonic()
    server = start_server(port)
    url = f"http://127.0.0.1:{port}"
    try:
        warm_up(url, headers)
        tally = fuzz(url, headers, args.examples, Tally(),
                     modes=args.modes.split(","),
                     paths=None if args.paths is None else args.paths.split(","),
                     seed=args.seed, concurrency=args.concurrency,
                     coverage_limit=args.coverage_limit, seconds_per_mode=args.seconds_per_mode)
        final = final_checks(url, headers, metrics_state_reader(url))
    finally:
        server.terminate()
        final_exit = server.wait(timeout=120)
    final["server_exit_code"] = final_exit
    result = {"commit": source_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                               time.gmtime()),
              "examples_per_operation_and_mode": args.examples, "seed": args.seed,
              "modes": args.modes, "concurrency": args.concurrency,
              "seconds_per_mode": args.seconds_per_mode,
              "max_tokens": MAX_TOKENS, "seconds": round(time.monotonic() - started, 1),
              **tally.as_json(), "final": final}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if final["ok"] and not result["problems"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxllm.benchmarks.fuzz_server",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
