"""``python -m jaxllm.benchmarks.soak``: a long run of ``jaxllm serve`` under steady mixed load,
with what it must not do measured (issue 20): grow its memory, lose a request, keep KV blocks.

It starts the server (the embedded model unless told otherwise; the engine core in its own
process, as ``jaxllm serve`` runs by default), sends Poisson arrivals at ``--rate`` for
``--minutes``: completions and chats, streamed or not, one stream in eight cut by the client
after a few chunks, and a few multi-turn conversations whose growing history shares its prefix
with the turn before. Every ``--sample-interval`` seconds it records the resident memory of
the front end and of the engine-core process (from /proc), and the server's KV usage and
queue depths (from /metrics). Then it waits for the server to drain, reads the KV usage,
sends SIGTERM and records the exit status.

Verdicts (the JSON's ``checks``): RSS growth over the second half < 2% for each process, every
request answered (each has an outcome, and the server's own response count equals the number
sent), no 5xx, KV usage 0 after the drain, exit status 0.

    python -m jaxllm.benchmarks.soak --minutes 30 --rate 1 --output-json soak.json --plot soak.png
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time

from jaxllm.benchmarks import server_process

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
TOPICS = ["the sea", "a robot", "bread", "winter", "a library", "trains", "the moon", "tea"]


@dataclasses.dataclass
class Outcome:
    kind: str  # "completion" | "chat" | "conversation"
    stream: bool
    cut: bool  # the client meant to close the stream early
    result: str = "pending"  # "ok" | "cut" | "http <status>" | "error <type>"
    seconds: float = 0.0


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def engine_core_pid(pid: int) -> int | None:
    """The server's engine-core child (spawned by multiprocessing; its resource tracker is
    another child)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(p) for p in f.read().split()]
        for child in children:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return child
    except OSError:
        pass
    return None


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        match = re.match(r"jaxllm:(\w+)(\{[^}]*\})? ([-0-9.e+]+)$", line)
        if match:
            name, labels, value = match.groups()
            if name == "http_requests_total":
                route = re.search(r'handler="([^"]+)"', labels or "")
                if route and route.group(1) in ENDPOINTS:
                    values["responses"] = values.get("responses", 0.0) + float(value)
                    status = re.search(r'status="(\d+)"', labels).group(1)
                    values[f"status_{status}"] = values.get(f"status_{status}", 0) + float(value)
            else:
                values[name] = float(value)
    return values


class Load:
    def __init__(self, base_url: str, seed: int, conversations: int):
        self.base_url = base_url
        self.rng = random.Random(seed)
        self.histories = [[] for _ in range(conversations)]
        self.outcomes: list[Outcome] = []

    def next_request(self) -> tuple[str, dict, Outcome, list | None]:
        """The next request, and the conversation history its answer extends (None if not
        one)."""
        rng = self.rng
        stream = rng.random() < 0.5
        cut = stream and rng.random() < 1 / 8
        max_tokens = rng.randint(8, 48)
        roll, history = rng.random(), None
        if roll < 0.2 and self.histories:  # a turn of a conversation: its history is the prefix
            history = rng.choice(self.histories)
            if len(history) >= 12:
                history.clear()
            history.append({"role": "user", "content": f"Tell me more about {rng.choice(TOPICS)}."})
            body = {"messages": list(history), "max_tokens": max_tokens}
            outcome, endpoint = Outcome("conversation", stream, cut), ENDPOINTS[1]
        elif roll < 0.6:
            body = {"messages": [{"role": "user", "content": f"Write about {rng.choice(TOPICS)}."}],
                    "max_tokens": max_tokens}
            outcome, endpoint = Outcome("chat", stream, cut), ENDPOINTS[1]
        else:
            body = {"prompt": f"A short note on {rng.choice(TOPICS)}:", "max_tokens": max_tokens}
            outcome, endpoint = Outcome("completion", stream, cut), ENDPOINTS[0]
        body |= {"temperature": rng.choice([0.0, 0.7, 1.0]), "stream": stream,
                 "seed": rng.randint(0, 2**31)}
        self.outcomes.append(outcome)
        return endpoint, body, outcome, history

    async def send(self, session, endpoint: str, body: dict, outcome: Outcome,
                   history: list | None) -> None:
        start = time.monotonic()
        try:
            async with session.post(self.base_url + endpoint, json=body) as response:
                if response.status != 200:
                    await response.read()
                    outcome.result = f"http {response.status}"
                    return
                if not body["stream"]:
                    data = await response.json()
                    outcome.result = "ok" if data["choices"][0]["finish_reason"] else "no finish"
                    if history is not None:  # the next turn's prompt extends this one
                        history.append({"role": "assistant",
                                        "content": data["choices"][0]["message"]["content"]})
                    return
                chunks, done = 0, False
                cut_after = self.rng.randint(1, 4)
                async for line in response.content:
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b"data: "):
                        chunks += 1
                        if b'"error"' in line:
                            outcome.result = "error in stream"
                            return
                        if outcome.cut and chunks >= cut_after:
                            outcome.result = "cut"
                            return  # leaving the context closes the connection mid-stream
                outcome.result = "ok" if done else "stream ended without [DONE]"
        except Exception as e:  # noqa: BLE001 - every outcome is recorded
            outcome.result = f"error {type(e).__name__}"
        finally:
            outcome.seconds = time.monotonic() - start


async def run_load(args, base_url: str, pids: dict[str, int], samples: list) -> Load:
    import aiohttp

    load = Load(base_url, args.seed, args.conversations)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        sampler = asyncio.create_task(sample_forever(session, base_url, pids, samples,
                                                     args.sample_interval))
        tasks, t0 = [], time.monotonic()
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            await asyncio.sleep(load.rng.expovariate(args.rate))
            endpoint, body, outcome, history = load.next_request()
            tasks.append(asyncio.create_task(load.send(session, endpoint, body, outcome,
                                                       history)))
            tasks = [t for t in tasks if not t.done()]
        await asyncio.gather(*tasks)
        await asyncio.sleep(args.sample_interval)  # one sample after the last answer
        sampler.cancel()
    return load


async def sample_once(session, base_url: str, pids: dict[str, int]) -> dict:
    sample = {"time": time.monotonic()}
    for name, pid in pids.items():
        sample[f"rss_{name}"] = rss_bytes(pid)
    try:
        async with session.get(base_url + "/metrics") as response:
            sample |= parse_metrics(await response.text())
    except Exception as e:  # noqa: BLE001
        sample["metrics_error"] = repr(e)
    return sample


async def sample_forever(session, base_url, pids, samples, interval) -> None:
    while True:
        samples.append(await sample_once(session, base_url, pids))
        await asyncio.sleep(interval)


def second_half_growth(samples: list[dict], key: str) -> float | None:
    """Relative growth from the middle to the end, each the median of the samples in a window
    of a tenth of the run (one sample would follow the allocator's noise)."""
    values = [s[key] for s in samples if s.get(key)]
    if len(values) < 10:
        return None
    w = max(1, len(values) // 10)
    mid = len(values) // 2
    middle = statistics.median(values[mid - w // 2: mid - w // 2 + w])
    end = statistics.median(values[-w:])
    return (end - middle) / middle


def start_server(args, port: int, log_path: str) -> subprocess.Popen:
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return server_process.start_server(port, ["--disable-log-requests", *args.server_args],
                                           stdout=log, timeout=args.start_timeout)


def run(args) -> dict:
    """The soak; exits 1 (SystemExit) after writing its report when a check failed."""
    args.server_args = [a for a in args.server_args if a != "--"]
    port = server_process.free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = args.server_log or (os.path.splitext(args.output_json or "soak")[0] + "_server.log")
    proc = start_server(args, port, log_path)
    core = engine_core_pid(proc.pid)
    pids = {"frontend": proc.pid} | ({"engine": core} if core else {})
    samples: list[dict] = []
    started = time.time()
    load = asyncio.run(run_load(args, base_url, pids, samples))

    async def drained() -> dict:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 60
            while True:
                last = await sample_once(session, base_url, pids)
                idle = not (last.get("num_requests_running") or last.get("num_requests_waiting"))
                if (idle and last.get("kv_cache_usage_perc") == 0) or time.monotonic() > deadline:
                    return last

    final = asyncio.run(drained())
    proc.send_signal(signal.SIGTERM)
    exit_status = proc.wait(120)
    results: dict[str, int] = {}
    for o in load.outcomes:
        results[o.result] = results.get(o.result, 0) + 1
    sent = len(load.outcomes)
    growth = {name: second_half_growth(samples, f"rss_{name}") for name in pids}
    five_xx = sum(v for k, v in final.items() if k.startswith("status_5"))
    checks = {
        "rss_growth_second_half_below_2pct": all(g is not None and g < 0.02
                                                 for g in growth.values()),
        "every_request_has_an_outcome": results.get("pending", 0) == 0,
        "server_counted_every_request": final.get("responses") == sent,
        "no_5xx": five_xx == 0 and not any(r.startswith("http 5") for r in results),
        "kv_usage_zero_after_drain": final.get("kv_cache_usage_perc") == 0,
        "exit_status_0": exit_status == 0,
    }
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started)),
              "minutes": args.minutes, "rate": args.rate, "server_args": args.server_args,
              "requests_sent": sent, "outcomes": results, "server_final": final,
              "rss_growth_second_half": growth, "exit_status": exit_status, "checks": checks,
              "passed": all(checks.values()), "samples": samples,
              "by_kind": {k: sum(o.kind == k for o in load.outcomes)
                          for k in ("completion", "chat", "conversation")},
              "streamed": sum(o.stream for o in load.outcomes),
              "cut": sum(o.cut for o in load.outcomes)}
    print(f"soak: {sent} requests over {args.minutes} min ({report['by_kind']}, "
          f"{report['streamed']} streamed, {report['cut']} cut by the client)")
    print(f"outcomes: {results}; server counted {final.get('responses')}")
    for name, g in growth.items():
        first = next((s[f'rss_{name}'] for s in samples if s.get(f'rss_{name}')), None)
        print(f"RSS {name}: start {first / 2**20 if first else float('nan'):.0f} MiB, "
              f"second-half growth {100 * g if g is not None else float('nan'):.2f}%")
    print(f"after the drain: KV usage {final.get('kv_cache_usage_perc')}, exit status "
          f"{exit_status}")
    print("checks:", ", ".join(f"{k}={'ok' if v else 'FAILED'}" for k, v in checks.items()))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    if not report["passed"]:
        raise SystemExit(1)
    return report


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    t0 = samples[0]["time"]
    minutes = [(s["time"] - t0) / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for key, label in (("rss_frontend", "front end"), ("rss_engine", "engine core")):
        axes[0].plot(minutes, [(s.get(key) or float("nan")) / 2**20 for s in samples], label=label)
    axes[0].set_ylabel("host RSS (MiB)")
    axes[0].legend()
    axes[1].plot(minutes, [100 * s.get("kv_cache_usage_perc", float("nan")) for s in samples])
    axes[1].set_ylabel("KV usage (%)")
    for key in ("num_requests_running", "num_requests_waiting"):
        axes[2].plot(minutes, [s.get(key, float("nan")) for s in samples],
                     label=key.removeprefix("num_requests_"))
    axes[2].set_ylabel("requests")
    axes[2].set_xlabel("minutes")
    axes[2].legend()
    fig.suptitle(f"soak: {report['requests_sent']} requests at {report['rate']}/s, "
                 f"{report['minutes']} min ({'passed' if report['passed'] else 'FAILED'})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--sample-interval", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--server-log", default=None)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("server_args", nargs=argparse.REMAINDER,
                        help="after --: flags for jaxllm serve")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
