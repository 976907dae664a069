"""``bench throughput / latency / serve`` end to end on CPU at tiny sizes: a tiny dummy model
(a config.json with random weights), the shipped SmolLM2, and a live ``python -m jaxllm.serve``.
The Hugging Face backends: test_bench_hf.py."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
from conftest import tiny_bench_args
from jaxllm.benchmarks.__main__ import main as bench_main

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("backend, layers", [("jaxllm", []), ("jax-static", []),
                                             ("jax-static", ["--unroll-layers",
                                                             "--jax-static-batch-size", "3"])])
def test_throughput_single_backend_in_process(tiny_config, tmp_path, backend, layers, capsys,
                                              monkeypatch):
    # A device with memory statistics (CPU has none): the peak is the largest sample of bytes in
    # use during the timed run; the planned figure (held + the compiled step's temporaries) is
    # an extra beside it.
    import jaxllm.benchmarks.jax_backends as jax_backends

    monkeypatch.setattr(jax_backends, "device_bytes_in_use", lambda: 1000)
    out = tmp_path / "tp.json"
    rc = bench_main(["throughput", "--backend", backend, *tiny_bench_args(tiny_config),
                     "--dataset-name", "random", "--num-prompts", "6", "--input-len", "20",
                     "--output-len", "8", "--range-ratio", "0.5", "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "64", "--max-model-len", "256",
                     "--enforce-eager", "--n", "2", *layers, "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())["results"][backend]
    assert r["num_requests"] == 6 and "token_count_error" not in r
    assert r["total_output_tokens"] == r["requested_output_tokens"] > 0
    assert r["output_tokens_per_second"] == pytest.approx(
        r["total_output_tokens"] / r["elapsed_time"])
    assert r["peak_memory_bytes"] == 1000 and "largest of" in r["peak_memory_kind"]
    assert r["held_bytes"] == 1000 and r["max_step_temp_bytes"] > 0
    assert r["planned_peak_bytes"] == 1000 + r["max_step_temp_bytes"]
    assert "jax_peak_bytes_in_use" in r or r["device"] == "cpu"
    # KV waste and pool utilisation, one definition (jaxllm.engine.kv_usage), summed over steps.
    assert 0 < r["kv_slots_used"] <= r["kv_slots_reserved"] <= r["kv_slots_capacity"]
    assert r["kv_waste"] == pytest.approx(1 - r["kv_slots_used"] / r["kv_slots_reserved"])
    assert r["kv_pool_utilisation"] == pytest.approx(
        r["kv_slots_reserved"] / r["kv_slots_capacity"])
    printed = capsys.readouterr().out
    assert f"[{backend}] Throughput:" in printed and "pool utilisation" in printed
    if backend == "jax-static":  # 6 prompts x n=2 rows, 4 (--max-num-seqs) or 3 at a time
        assert (r["batch_size"], r["num_batches"]) == ((3, 4) if layers else (4, 3))
        assert r["kv_pool_utilisation"] == 1.0  # the whole contiguous cache is reserved
    if backend == "jaxllm":
        assert r["stream_outputs"] is False  # offline like LLM.generate: no partial outputs
        assert r["kv_slots_reserved"] % 16 == 0  # whole blocks of the block tables
        assert r["kv_slots_capacity"] == r["kv_steps"] * (r["num_gpu_blocks"] - 1) * 16
        # where each step's time went, the step count since the clock
        ms = r["step_phases_ms"]
        assert all(v >= 0 for v in ms.values()) and ms["schedule_ms"] > 0
        assert sum(ms.values()) <= r["step_ms"] * 1.05 and "host critical path" in printed


@pytest.mark.parametrize("backend", ["jaxllm", "jax-static"])
def test_throughput_counts_what_the_backend_produced(tiny_config, tmp_path, backend, capsys,
                                                     monkeypatch):
    """A backend that produces one token fewer than asked is reported with what it produced,
    and the run fails loudly (its JSON still written, with the error)."""
    import jaxllm

    if backend == "jaxllm":  # the engine stops one token early for every request
        real = jaxllm.SamplingParams
        monkeypatch.setattr(jaxllm, "SamplingParams", lambda **kw: real(
            **(kw | {"max_tokens": kw["max_tokens"] - 1})))
    else:  # generate() reports one token fewer for row 0 of every batch
        real = jaxllm.generate
        monkeypatch.setattr(jaxllm, "generate", lambda *a, **kw: (o := real(*a, **kw))._replace(
            num_tokens=o.num_tokens.at[0].add(-1)))
    out = tmp_path / "short.json"
    rc = bench_main(["throughput", "--backend", backend, *tiny_bench_args(tiny_config),
                     "--dataset-name", "random", "--num-prompts", "3", "--input-len", "12",
                     "--output-len", "6", "--max-num-seqs", "4", "--max-num-batched-tokens",
                     "64", "--max-model-len", "128", "--enforce-eager", "--output-json",
                     str(out)])
    assert rc == 2
    r = json.loads(out.read_text())["results"][backend]
    short = 3 if backend == "jaxllm" else 1
    assert (r["requested_output_tokens"], r["total_output_tokens"]) == (18, 18 - short)
    assert f"{backend} produced {18 - short} output tokens" in r["token_count_error"]
    assert "asked for 18" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_server(tiny_config, tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w+")
    cmd = [sys.executable, "-m", "jaxllm.serve", "--model", tiny_config, "--load-format", "dummy",
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
           "--disable-log-requests", "--disable-log-stats"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.2)
    try:
        assert proc.poll() is None, log.read()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


@pytest.mark.parametrize("rate", ["inf", "30"])
def test_serve_against_a_live_server(tiny_server, tmp_path, rate, capsys):
    assert bench_main(["serve", "--base-url", tiny_server, "--vocab-size", "512",
                       "--dataset-name", "random", "--num-prompts", "12", "--input-len", "24",
                       "--output-len", "6", "--range-ratio", "0.5", "--request-rate", rate,
                       "--burstiness", "0.5", "--max-concurrency", "6", "--no-progress",
                       "--save-result", "--result-dir", str(tmp_path),
                       "--result-filename", "serve.json", "--plot"]) == 0
    r = json.loads((tmp_path / "serve.json").read_text())
    assert r["completed"] == 12 and r["failed"] == 0 and not any(r["errors"])
    assert r["total_output_tokens"] == sum(r["output_lens"])
    assert r["total_input_tokens"] == sum(r["input_lens"])
    # A chunk carries every token generated since the stream's last one (one each while the
    # client keeps up, several when it lags, as vLLM's server does): an ITL gap per chunk
    # after the first, so at most output tokens - 1 of them.
    assert all(0 <= len(g) <= n - 1 for g, n in zip(r["itls"], r["output_lens"], strict=True))
    assert sum(map(len, r["itls"])) > 0
    assert r["mean_ttft_ms"] > 0 and r["p99_itl_ms"] >= r["median_itl_ms"] >= 0
    # Scraped from /metrics every 0.5 s, so a sub-second run may only see an idle server.
    assert 0 <= r["peak_kv_cache_usage_perc"] <= 1 and r["num_preemptions"] == 0
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "Successful requests:" in capsys.readouterr().out


def test_serve_client_keeps_every_request_in_flight_at_rate_inf():
    """At rate inf nothing but --max-concurrency limits the requests in flight (aiohttp's
    default connector would hold 100 and queue the rest in the client)."""
    import asyncio

    from aiohttp import web
    from jaxllm.benchmarks.datasets import Request
    from jaxllm.benchmarks.serve_client import run_benchmark

    num = 130
    in_flight = {"now": 0, "max": 0}
    everyone_in = asyncio.Event()

    async def models(request):
        return web.json_response({"data": [{"id": "fake"}]})

    async def completions(request):
        body = await request.json()
        warm_up = body["max_tokens"] == 4
        in_flight["now"] += 1
        in_flight["max"] = max(in_flight["max"], in_flight["now"])
        if in_flight["now"] >= num:
            everyone_in.set()
        try:
            if not warm_up:  # hold every request until all are open (or give up after 20 s)
                await asyncio.wait_for(everyone_in.wait(), 20)
        except TimeoutError:
            pass
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"text": f"t{i}"}], "usage": {"completion_tokens": i + 1}}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        in_flight["now"] -= 1
        return response

    async def main():
        app = web.Application()
        app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions),
                        web.get("/metrics", lambda r: web.Response(text=""))])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            requests = [Request([1, 2, 3], 5) for _ in range(num)]
            return await run_benchmark(f"http://127.0.0.1:{port}", None, requests,
                                       progress=False, scrape_interval=5)
        finally:
            await runner.cleanup()

    traces, _ = asyncio.run(main())
    assert all(t.success and t.output_tokens == 5 for t in traces)
    assert in_flight["max"] == num


@pytest.mark.parametrize("flag, value", [("--jax-static-batch-size", "0"),
                                         ("--jax-static-batch-size", "-2"),
                                         ("--hf-max-batch-size", "0")])
def test_throughput_refuses_a_static_batch_below_one(tiny_config, flag, value, capsys):
    with pytest.raises(SystemExit):
        bench_main(["throughput", *tiny_bench_args(tiny_config), "--backend", "jax-static",
                    "--num-prompts", "4", flag, value])
    assert f"argument {flag}: {value} must be >= 1" in capsys.readouterr().err
