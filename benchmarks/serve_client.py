"""``bench serve``: load-test any OpenAI-compatible server over streaming ``/v1/completions``.

    python -m jaxllm.serve --load-format dummy --model llama-3-8b --dtype bfloat16 &
    python -m jaxllm.benchmarks serve --base-url http://127.0.0.1:8000 \\
        --dataset-name sharegpt-like \\
        --num-prompts 1000 --request-rate 10 --save-result --plot

Client only; it follows vLLM's ``benchmark_serving.py``: one warm-up request, then requests
sent at gamma-distributed intervals (shape ``--burstiness``, mean ``1 / --request-rate``;
burstiness 1 is a Poisson process, ``inf`` sends all at once), at most ``--max-concurrency`` in
flight. Prompts are token-id lists (the same ones ``bench throughput`` uses), so no tokenizer is
needed here. Output tokens per request come from the server's streamed ``usage``
(``continuous_usage_stats``: a chunk counts as a token arrival when completion_tokens grows;
servers without it: when it carries text). Metric definitions: :mod:`benchmarks.metrics`.
While the run lasts, ``/metrics`` is scraped for the peak of ``jaxllm:kv_cache_usage_perc``
(or vLLM's names) and the growth of ``jaxllm:num_preemptions``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import time

import numpy as np
from jaxllm.benchmarks.datasets import Request, add_dataset_args, sample_requests
from jaxllm.benchmarks.metrics import RequestTrace, parse_prometheus, print_summary, summarize
from jaxllm.benchmarks.provenance import source_commit

KV_USAGE_NAMES = ("jaxllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc")
PREEMPTION_NAMES = ("jaxllm:num_preemptions_total", "jaxllm:num_preemptions",
                    "vllm:num_preemptions_total")


def request_intervals(num: int, request_rate: float, burstiness: float = 1.0,
                      seed: int = 0) -> np.ndarray:
    """Seconds to wait before each request: Gamma(shape=burstiness, scale=1/(rate*burstiness)),
    so the mean is 1/rate and the coefficient of variation 1/sqrt(burstiness). rate=inf: 0."""
    if burstiness <= 0:
        raise ValueError(f"burstiness={burstiness} must be > 0")
    if request_rate <= 0:
        raise ValueError(f"request_rate={request_rate} must be > 0 (or inf)")
    if math.isinf(request_rate):
        return np.zeros(num)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)


def _first_value(metrics: dict[str, float], names: tuple[str, ...]) -> float | None:
    return next((metrics[n] for n in names if n in metrics), None)


async def send_request(session, url: str, model: str, request: Request,
                       ignore_eos: bool, logprobs: int | None = None) -> RequestTrace:
    """One streaming completion; never raises (errors land in the trace)."""
    trace = RequestTrace(prompt_len=request.prompt_len)
    payload = {"model": model, "prompt": list(request.prompt_ids), "max_tokens":
               request.output_len, "temperature": 0.0, "stream": True, "ignore_eos": ignore_eos,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if logprobs is not None:
        payload["logprobs"] = logprobs
    trace.start = start = time.perf_counter()
    last = start
    tokens_seen = chunks_with_text = 0
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                trace.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return trace
            async for raw in response.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    trace.error = str(chunk["error"])[:200]
                    return trace
                usage = chunk.get("usage") or {}
                text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                grew = usage.get("completion_tokens", 0) > tokens_seen
                if chunk.get("choices") and (grew or text):
                    if tokens_seen == 0 and chunks_with_text == 0:
                        trace.ttft = now - start
                    else:
                        trace.itl.append(now - last)
                    last = now
                    chunks_with_text += 1
                tokens_seen = max(tokens_seen, usage.get("completion_tokens", 0))
            trace.latency = last - start
            trace.output_tokens = tokens_seen or chunks_with_text
            trace.success = trace.output_tokens > 0
            if not trace.success:
                trace.error = "no tokens received"
    except Exception as e:  # noqa: BLE001 (a failed request is a result, not a crash)
        trace.error = f"{type(e).__name__}: {e}"
    return trace


async def _scrape(session, url: str, stop: asyncio.Event, interval: float, out: dict) -> None:
    while True:
        try:
            async with session.get(url) as response:
                metrics = parse_prometheus(await response.text())
            usage = _first_value(metrics, KV_USAGE_NAMES)
            if usage is not None:
                out["peak_kv"] = max(out.get("peak_kv", 0.0), usage)
            preempted = _first_value(metrics, PREEMPTION_NAMES)
            if preempted is not None:
                out.setdefault("preempt_start", preempted)
                out["preempt_end"] = preempted
        except Exception:  # noqa: BLE001 (a server without /metrics: report nothing)
            pass
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass


async def run_benchmark(base_url: str, model: str | None, requests: list[Request], *,
                        endpoint: str = "/v1/completions", request_rate: float = float("inf"),
                        burstiness: float = 1.0, max_concurrency: int | None = None,
                        ignore_eos: bool = True, seed: int = 0, progress: bool = True,
                        scrape_interval: float = 0.5, logprobs: int | None = None
                        ) -> tuple[list[RequestTrace], dict]:
    """Warm-up, then the timed run. Returns the traces and run info (duration, /metrics)."""
    import aiohttp
    from tqdm.auto import tqdm

    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    # aiohttp's default connector holds at most 100 connections: at rate inf the rest would
    # queue in this client (measured as TTFT) instead of at the server. Only
    # --max-concurrency limits what is in flight (+1: the /metrics scraper).
    connector = aiohttp.TCPConnector(limit=max_concurrency + 1 if max_concurrency else 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if model is None:
            async with session.get(base_url + "/v1/models") as response:
                model = (await response.json())["data"][0]["id"]
        url = base_url + endpoint
        warm = await send_request(session, url, model, Request(requests[0].prompt_ids, 4),
                                  ignore_eos, logprobs)
        if not warm.success:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        if logprobs is None and warm.output_tokens > 1 and not warm.itl:
            # A server without a tokenizer (dummy weights) streams no empty-text chunks;
            # asking for logprobs makes it send one chunk per token.
            print("note: the server streamed all tokens in one chunk (no tokenizer?); "
                  "sending logprobs=0 so that every token arrives on its own")
            logprobs = 0
        scraped: dict = {}
        stop = asyncio.Event()
        scraper = asyncio.create_task(_scrape(session, base_url + "/metrics", stop,
                                              scrape_interval, scraped))
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", disable=not progress, unit="req")

        async def one(request: Request) -> RequestTrace:
            if semaphore is None:
                trace = await send_request(session, url, model, request, ignore_eos, logprobs)
            else:
                async with semaphore:
                    trace = await send_request(session, url, model, request, ignore_eos,
                                               logprobs)
            bar.update(1)
            return trace

        intervals = request_intervals(len(requests), request_rate, burstiness, seed)
        start = time.perf_counter()
        tasks = []
        for request, wait in zip(requests, intervals, strict=True):
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(request)))
        traces = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
        stop.set()
        await scraper
    info = {"duration": duration, "start": start, "model_id": model, "logprobs": logprobs,
            "peak_kv_cache_usage_perc": scraped.get("peak_kv"),
            "num_preemptions": (scraped["preempt_end"] - scraped["preempt_start"]
                                if "preempt_start" in scraped else None)}
    return traces, info


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="model name to send (default: the "
                                                       "first of /v1/models)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="token ids are drawn below this (default: from --tokenizer-preset "
                             "or 32000)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s; inf sends all at t=0")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival process: 1 = Poisson, < 1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="fixed output lengths (default on: dummy weights hit EOS at random)")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="logprobs to request (default: none, or 0 when the server "
                             "has no tokenizer and would otherwise batch the tokens)")
    parser.add_argument("--metric-percentiles", default="50,90,99")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--plot", action="store_true",
                        help="latency CDFs and throughput over time, PNG next to the result")
    parser.add_argument("--no-progress", action="store_true")
    add_dataset_args(parser)


def run(args: argparse.Namespace) -> dict:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    requests = sample_requests(args.dataset_name, args.num_prompts, args.vocab_size or 32000,
                               seed=args.seed, input_len=args.input_len,
                               output_len=args.output_len, range_ratio=args.range_ratio)
    if args.n != 1:
        raise ValueError("bench serve sends n=1 requests (repeat prompts with --num-prompts)")
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    traces, info = asyncio.run(run_benchmark(
        base_url, args.model, requests, endpoint=args.endpoint, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos, seed=args.seed, progress=not args.no_progress,
        logprobs=args.logprobs))
    result = summarize(traces, info["duration"], percentiles)
    result |= {k: info[k] for k in ("peak_kv_cache_usage_perc", "num_preemptions")}
    print_summary("Serving Benchmark Result", result, percentiles)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    name = args.result_filename or f"serve_{args.dataset_name}_rate{rate}_{stamp}.json"
    result |= {
        "date": stamp, "commit": source_commit(), "base_url": base_url,
        "model_id": info["model_id"],
        "logprobs_sent": info["logprobs"],
        "args": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                 for k, v in vars(args).items() if k != "handler"},
        "input_lens": [t.prompt_len for t in traces],
        "output_lens": [t.output_tokens for t in traces],
        "ttfts": [t.ttft for t in traces], "itls": [t.itl for t in traces],
        "start_times": [t.start - info["start"] for t in traces],
        "errors": [t.error for t in traces],
    }
    if args.save_result or args.plot:
        os.makedirs(args.result_dir, exist_ok=True)
    if args.save_result:
        path = os.path.join(args.result_dir, name)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"result: {path}")
    if args.plot:
        from jaxllm.benchmarks.plots import plot_serve

        path = os.path.join(args.result_dir, os.path.splitext(name)[0] + ".png")
        plot_serve(traces, info["start"], path, title=f"{info['model_id']}, rate {rate}")
        print(f"plot: {path}")
    return result
