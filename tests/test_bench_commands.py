"""``bench throughput / latency / serve`` end to end on CPU at tiny sizes: a tiny dummy model
(a config.json with random weights), the shipped SmolLM2, and a live ``python -m jaxllm.serve``."""

from __future__ import annotations

import json
import math
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
from jaxllm.benchmarks.__main__ import main as bench_main

ROOT = pathlib.Path(__file__).resolve().parent.parent
REF_PYTHON = "/work/refvenv/bin/python"  # Python 3.11 with torch (CPU) + transformers
TINY_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def _has_torch(python: str) -> bool:
    return os.path.exists(python) and subprocess.run(
        [python, "-c", "import torch, transformers"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY_HF_CONFIG))
    return str(path)


def _tiny_args(config: str) -> list[str]:
    return ["--model", config, "--load-format", "dummy", "--dtype", "float32", "--no-progress"]


@pytest.mark.parametrize("backend, layers", [("jaxllm", []), ("jax-static", []),
                                             ("jax-static", ["--unroll-layers",
                                                             "--jax-static-batch-size", "3"])])
def test_throughput_single_backend_in_process(tiny_config, tmp_path, backend, layers, capsys,
                                              monkeypatch):
    # A device with memory statistics (CPU has none): held bytes come from them, and the
    # reported peak adds the compiled step's temporaries (the raw JAX peak is kept aside).
    import jaxllm.benchmarks.jax_backends as jax_backends

    monkeypatch.setattr(jax_backends, "device_bytes_in_use", lambda: 1000)
    out = tmp_path / "tp.json"
    rc = bench_main(["throughput", "--backend", backend, *_tiny_args(tiny_config),
                     "--dataset-name", "random", "--num-prompts", "6", "--input-len", "20",
                     "--output-len", "8", "--range-ratio", "0.5", "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "64", "--max-model-len", "256",
                     "--enforce-eager", "--n", "2", *layers, "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())["results"][backend]
    assert r["num_requests"] == 6 and r["generated_tokens"] == r["total_output_tokens"]
    assert r["output_tokens_per_second"] > 0 and r["peak_memory_bytes"] > 0
    assert 0 <= r["kv_waste"] < 1
    assert r["held_bytes"] == 1000 and r["max_step_temp_bytes"] > 0
    assert r["peak_memory_bytes"] == 1000 + r["max_step_temp_bytes"]
    assert "jax_peak_bytes_in_use" in r
    printed = capsys.readouterr().out
    assert f"[{backend}] Throughput:" in printed
    if backend == "jax-static":  # 6 prompts x n=2 rows, 4 (--max-num-seqs) or 3 at a time
        assert (r["batch_size"], r["num_batches"]) == ((3, 4) if layers else (4, 3))
    if backend == "jaxllm":
        assert r["stream_outputs"] is False  # offline like LLM.generate: no partial outputs
        # where each step's time went, the step count since the clock
        ms = r["step_phases_ms"]
        assert all(v >= 0 for v in ms.values()) and ms["schedule_ms"] > 0
        assert sum(ms.values()) <= r["step_ms"] * 1.05 and "host critical path" in printed


def test_throughput_side_by_side_with_hf(tiny_config, tmp_path):
    """One run, several backends, each in its own process (two at a time through --devices);
    hf through the reference venv."""
    backends = "jaxllm,hf" if _has_torch(REF_PYTHON) else "jaxllm,jax-static"
    out = tmp_path / "side.json"
    cmd = [sys.executable, "-m", "jaxllm.benchmarks", "throughput", "--backend", backends,
           *_tiny_args(tiny_config), "--hf-python", REF_PYTHON, "--dataset-name",
           "sharegpt-like", "--num-prompts", "8", "--max-num-seqs", "4",
           "--max-model-len", "1024", "--max-num-batched-tokens", "256", "--enforce-eager",
           "--output-json", str(out), "--plot", "--devices", "0,1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert list(results) == backends.split(",")
    tokens = {r["total_output_tokens"] for r in results.values()}
    prompts = {r["total_prompt_tokens"] for r in results.values()}
    assert len(tokens) == 1 and len(prompts) == 1  # identical inputs for every backend
    assert "side by side" in proc.stdout
    assert (tmp_path / "side.png").stat().st_size > 0
    for b in backends.split(","):  # each child's own result survives next to the summary
        assert json.loads((tmp_path / f"side.{b}.json").read_text())["results"][b]


@pytest.mark.slow
def test_throughput_on_smollm2(tmp_path):
    out = tmp_path / "smol.json"
    assert bench_main(["throughput", "--backend", "jaxllm", "--num-prompts", "4",
                       "--input-len", "16", "--output-len", "4", "--max-num-seqs", "4",
                       "--max-num-batched-tokens", "64", "--max-model-len", "128",
                       "--enforce-eager", "--no-progress", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]["jaxllm"]
    assert r["model"] == "SmolLM2-135M-Instruct" and r["total_output_tokens"] == 16


def test_latency_reports_percent_of_roofline(tiny_config, tmp_path, capsys):
    out = tmp_path / "lat.json"
    assert bench_main(["latency", *_tiny_args(tiny_config), "--batch-sizes", "1,3",
                       "--context-len", "40", "--iters", "3", "--warmup-iters", "1",
                       "--bandwidth-gbps", "10", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [row["batch_size"] for row in r["rows"]] == [1, 3]
    assert r["bandwidth_source"] == "given" and r["bandwidth_gbps"] == 10 and r["commit"]
    for row in r["rows"]:
        assert row["step_ms"] > 0
        assert row["pct_of_roofline"] == pytest.approx(
            100 * row["roofline_ms"] / row["step_ms"])
    assert "% roofline" in capsys.readouterr().out


def test_latency_measures_bandwidth_via_the_jaxllm_cli(tiny_config, tmp_path):
    from jaxllm.cli import main as jaxllm_main

    out = tmp_path / "lat.json"
    assert jaxllm_main(["bench", "latency", *_tiny_args(tiny_config), "--batch-sizes", "2",
                        "--context-len", "16", "--iters", "2", "--copy-mib", "8",
                        "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bandwidth_source"].startswith("measured") and r["bandwidth_gbps"] > 0


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


def test_hf_batches_dealt_to_devices_and_their_times_summed(tmp_path):
    """--hf-devices: whole static batches, round-robin, one child per device at the same time;
    the reported time is the sum of the children's (one device runs the batches in turn)."""
    from jaxllm.benchmarks.datasets import Request
    from jaxllm.benchmarks.hf_backend import run_hf

    child = tmp_path / "fake_child.py"  # stands in for torch: records what it was given
    child.write_text(
        "import json, os, sys\n"
        "job = json.load(open(sys.argv[1]))\n"
        "reqs = job['requests']\n"
        "json.dump({'elapsed_s': 0.5 * len(reqs), 'peak_memory_bytes': 10 * len(reqs),\n"
        "           'device': os.environ.get('CUDA_VISIBLE_DEVICES'), 'batch_size':\n"
        "           job['batch_size'], 'seen': [r[1] for r in reqs]}, open(sys.argv[2], 'w'))\n")
    python = tmp_path / "fake_python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {child} \"$2\" \"$3\"\n")
    python.chmod(0o755)
    requests = [Request([1, 2], output_len=i + 1) for i in range(10)]  # batches of 4, 4, 2
    whole = run_hf(requests, hf_python=str(python), model=None, hf_config={}, dtype="float32",
                   batch_size=4, progress=False)
    assert whole["elapsed_s"] == 5.0 and whole["seen"] == list(range(1, 11))
    split = run_hf(requests, hf_python=str(python), model=None, hf_config={}, dtype="float32",
                   batch_size=4, progress=False, devices=["0", "1"])
    assert split["elapsed_s"] == whole["elapsed_s"]  # 6 + 4 requests at 0.5 s each
    assert split["peak_memory_bytes"] == 60 and split["wall_s"] > 0
    assert [(s["device"], s["num_requests"]) for s in split["shards"]] == [("0", 6), ("1", 4)]
    assert split["seen"] == [1, 2, 3, 4, 9, 10]  # device 0: batches 0 and 2, whole and in order


def test_results_name_the_source_they_ran(monkeypatch):
    from jaxllm.benchmarks.provenance import source_commit

    monkeypatch.delenv("JAXLLM_COMMIT", raising=False)
    described = source_commit()  # a git checkout: a commit id, "-dirty" if the tree differs
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT).stdout.strip()
    assert head in described
    monkeypatch.setenv("JAXLLM_COMMIT", "abc1234")  # a copied tree whose .git lags behind
    assert source_commit() == "abc1234"


def test_mixed_step_benchmark_smoke(tmp_path):
    """benchmarks/mixed_step.py end to end in the Pallas interpreter at tiny sizes."""
    from jaxllm.benchmarks.mixed_step import main as mixed_step_main

    out = tmp_path / "mixed.json"
    assert mixed_step_main(["--smoke", "--heads", "small_gqa", "--decodes", "5",
                            "--max-context", "60", "--chunks", "20@0,4@30",
                            "--padded-tokens", "40", "--layers", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["real_tokens"] == 29 and r["max_abs_diff_mixed_vs_prefill"] < 1e-2
    assert set(r["step_ms"]) == {"prefill_kernel", "mixed"} and r["mixed_speedup"] > 0


@pytest.mark.parametrize("layers", ["--no-unroll-layers", "--unroll-layers"])
def test_generate_step_benchmark_smoke(tiny_config, tmp_path, layers):
    """benchmarks/generate_step.py end to end on the tiny model: one row per capacity, the
    contiguous cache sized from the capacity, and a capacity too small for the run refused."""
    from jaxllm.benchmarks.generate_step import main as generate_step_main

    out = tmp_path / "gen.json"
    assert generate_step_main(["--model", tiny_config, "--dtype", "float32", "--batch-size", "2",
                               "--prompt-len", "8", "--capacities", "16,64", "--short", "2",
                               "--decode-steps", "4", layers, "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [row["capacity"] for row in r["rows"]] == [16, 64]
    assert r["unrolled"] == (layers == "--unroll-layers")
    # 2 rows x ceil((8 + C) / 16) blocks of 16 tokens, 2 layers x K and V x 2 heads x 16 x 4 B
    assert [row["contiguous_cache_bytes"] for row in r["rows"]] == [
        2 * n * 16 * 2 * 2 * 2 * 16 * 4 for n in (2, 5)]
    # Timings at this size are noise (a difference of two runs can go negative): only present.
    assert all(math.isfinite(row["decode_ms"] + row["prefill_ms"]) for row in r["rows"])
    with pytest.raises(SystemExit):
        generate_step_main(["--model", tiny_config, "--capacities", "4", "--short", "2",
                            "--decode-steps", "4"])


@pytest.mark.parametrize("flag, value", [("--jax-static-batch-size", "0"),
                                         ("--jax-static-batch-size", "-2"),
                                         ("--hf-max-batch-size", "0")])
def test_throughput_refuses_a_static_batch_below_one(tiny_config, flag, value, capsys):
    with pytest.raises(SystemExit):
        bench_main(["throughput", *_tiny_args(tiny_config), "--backend", "jax-static",
                    "--num-prompts", "4", flag, value])
    assert f"argument {flag}: {value} must be >= 1" in capsys.readouterr().err
