"""``bench throughput / latency / serve`` end to end on CPU at tiny sizes: a tiny dummy model
(a config.json with random weights), the shipped SmolLM2, and a live ``python -m jaxllm.serve``.

The Hugging Face backends run in the reference venv (``make fixtures`` builds ``.venv-ref``:
Python 3.11, CPU torch, transformers; ``JAXLLM_REF_PYTHON`` names another interpreter); tests that
need it say so when they skip."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
from conftest import TINY_HF_CONFIG, tiny_bench_args
from jaxllm.benchmarks.__main__ import main as bench_main

ROOT = pathlib.Path(__file__).resolve().parent.parent
REF_PYTHON = os.environ.get("JAXLLM_REF_PYTHON", str(ROOT / ".venv-ref" / "bin" / "python"))


def _ref_python() -> str:
    """The reference interpreter with torch + transformers, else the test is skipped (saying
    why: these tests must run hf, never something else in its place)."""
    if not os.path.exists(REF_PYTHON):
        pytest.skip(f"no reference venv at {REF_PYTHON} (make fixtures builds .venv-ref, or set "
                    "JAXLLM_REF_PYTHON): the Hugging Face backends cannot run")
    probe = subprocess.run([REF_PYTHON, "-c", "import torch, transformers"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        pytest.skip(f"{REF_PYTHON} cannot import torch + transformers: {probe.stderr[-300:]}")
    return REF_PYTHON


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


def test_throughput_side_by_side_with_hf(tiny_config, tmp_path):
    """One run, jaxllm beside vLLM's hf baseline, each in its own process (two at a time through
    --devices), hf really run through the reference venv."""
    ref = _ref_python()
    backends = "jaxllm,hf"
    out = tmp_path / "side.json"
    cmd = [sys.executable, "-m", "jaxllm.benchmarks", "throughput", "--backend", backends,
           *tiny_bench_args(tiny_config), "--hf-python", ref, "--dataset-name", "random",
           "--num-prompts", "6", "--input-len", "20", "--output-len", "8", "--range-ratio",
           "0.5", "--max-num-seqs", "4", "--max-model-len", "256",
           "--max-num-batched-tokens", "64", "--enforce-eager", "--output-json", str(out),
           "--plot", "--devices", "0,1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    results = summary["results"]
    assert list(results) == backends.split(",")
    hf = results["hf"]
    assert hf["torch"] and hf["transformers"] and hf["cache"] == "dynamic"
    for r in results.values():  # identical inputs, and every backend produced what was asked
        assert r["total_prompt_tokens"] == results["jaxllm"]["total_prompt_tokens"]
        assert r["total_output_tokens"] == r["requested_output_tokens"]
        assert r["peak_memory_bytes"] is None and r["peak_memory_kind"].startswith("n/a")
        assert 0 < r["kv_waste"] < 1
    assert hf["kv_pool_utilisation"] == 1.0  # rows x padded length, all of it allocated
    assert summary["ratios"]["jaxllm/hf"] == pytest.approx(
        results["jaxllm"]["output_tokens_per_second"] / hf["output_tokens_per_second"])
    assert "side by side" in proc.stdout and "jaxllm / hf output tokens/s" in proc.stdout
    assert (tmp_path / "side.png").stat().st_size > 0
    for b in backends.split(","):  # each child's own result survives next to the summary
        assert json.loads((tmp_path / f"side.{b}.json").read_text())["results"][b]


def _tiny_job(requests, **extra) -> dict:
    return {"variant": "hf", "requests": requests, "model": None,
            "hf_config": {k: v for k, v in TINY_HF_CONFIG.items() if k != "torch_dtype"},
            "dtype": "float32", "batch_size": 4, "n": 1, "seed": 0, "progress": False,
            "tuned_cache": "auto", "cb_max_requests": None} | extra


def test_hf_counts_tokens_from_the_returned_ids(tmp_path):
    """In the reference venv: the static-batch loop's count follows the ids generate()
    returned. generate() made to stop one step early loses the token of every row that asked
    for the batch's longest output; the count says so (it would not if it were the requested
    lengths)."""
    ref = _ref_python()
    for name in ("hf_backend.py", "hf_tuned.py", "device_memory.py"):
        (tmp_path / name).write_text((ROOT / "benchmarks" / name).read_text())
    requests = [[[5, 6, 7], 4], [[8, 9], 2], [[10], 4], [[11, 12, 13, 14], 3], [[15], 5]]
    code = (
        "import json, sys, torch\n"
        "import hf_backend\n"
        f"job = {_tiny_job(requests)!r}\n"
        "model = hf_backend.load_model(job, 'cpu', 'sdpa')\n"
        "real = model.generate\n"
        "model.generate = lambda **kw: real(**(kw | {'max_new_tokens': kw['max_new_tokens'] - 1,"
        " 'min_new_tokens': kw['min_new_tokens'] - 1}))\n"
        "with torch.inference_mode():\n"
        "    r = hf_backend.run_static_batches(model, job['requests'], job, 'cpu')\n"
        "print(json.dumps(r))\n")
    proc = subprocess.run([ref, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.splitlines()[-1])
    # batches [4, 2, 4, 3] (3 decode steps) and [5] (4 steps): rows asking for 4, 4, 5 lose one
    assert r["generated_tokens"] == (3 + 2 + 3 + 3) + 4 == sum(o for _, o in requests) - 3
    assert r["decoded_tokens"] == 4 * 3 + 1 * 4
    assert [b[:4] for b in r["kv_batches"]] == [[4, 4, 3, None], [1, 1, 4, None]]


@pytest.mark.parametrize("variant, cache", [("hf-tuned", "static"), ("hf-cb", "auto")])
def test_tuned_hf_backends_in_the_reference_venv(variant, cache):
    """hf-tuned (prompts sorted by length, sdpa, a static cache: CUDA would compile it) and hf-cb
    (transformers' continuous batching) on a tiny random model: each produces exactly the
    requested tokens, counted from what it returned."""
    ref = _ref_python()
    from jaxllm.benchmarks.datasets import sample_requests
    from jaxllm.benchmarks.hf_backend import run_hf

    requests = sample_requests("random", 6, 512, seed=3, input_len=20, output_len=8,
                               range_ratio=0.5)
    r = run_hf(requests, variant=variant, hf_python=ref, model=None,
               hf_config={k: v for k, v in TINY_HF_CONFIG.items() if k != "torch_dtype"},
               dtype="float32", batch_size=4, progress=False, tuned_cache=cache)
    assert r["generated_tokens"] == sum(q.output_len for q in requests)
    assert r["attn_implementation"] == "sdpa" and r["peak_memory_bytes"] is None
    if variant == "hf-cb":
        assert r["cache"].startswith("paged") and r["kv_waste"] is None and r["kv_note"]
        assert r["decoded_tokens"] == r["generated_tokens"]  # each request runs to its own end
        return
    ordered = sorted(requests, key=lambda q: -q.prompt_len)
    batches = [ordered[:4], ordered[4:]]
    assert r["cache"] == cache and r["sorted_by"] == "prompt length"
    # One shape: full batches (the last padded), a cache of the run's longest width + new.
    length = max(max(q.prompt_len for q in b) + max(q.output_len for q in b) for b in batches)
    assert r["static_cache_len"] == length and r["decoded_tokens"] == 4 * sum(
        max(q.output_len for q in b) for b in batches)
    reserved = sum(4 * length * max(q.output_len for q in b) for b in batches)
    assert r["kv_slots_reserved"] == reserved and r["kv_pool_utilisation"] == 1.0


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


def _fake_hf_python(tmp_path, short: int = 0) -> str:
    """An interpreter standing in for torch: its child records what it was given and reports
    each request's output length (``short`` fewer for the first) as produced."""
    child = tmp_path / "fake_child.py"
    child.write_text(
        "import json, os, sys\n"
        "job = json.load(open(sys.argv[1]))\n"
        "reqs = job['requests']\n"
        f"made = sum(r[1] for r in reqs) - ({short} if reqs else 0)\n"
        "json.dump({'elapsed_s': 0.5 * len(reqs), 'peak_memory_bytes': 10 * len(reqs),\n"
        "           'peak_memory_kind': 'fake', 'generated_tokens': made,\n"
        "           'decoded_tokens': made, 'kv_batches': [[len(reqs), 2, 1, None,\n"
        "           [len(r[0]) for r in reqs], [1 for r in reqs]]],\n"
        "           'device': os.environ.get('CUDA_VISIBLE_DEVICES'), 'batch_size':\n"
        "           job['batch_size'], 'variant': job['variant'],\n"
        "           'seen': [r[1] for r in reqs], 'widths': [len(r[0]) for r in reqs]},\n"
        "          open(sys.argv[2], 'w'))\n")
    python = tmp_path / "fake_python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {child} \"$2\" \"$3\"\n")
    python.chmod(0o755)
    return str(python)


def test_hf_batches_dealt_to_devices_and_their_times_summed(tmp_path):
    """--hf-devices: whole static batches, round-robin, one child per device at the same time;
    the reported time is the sum of the children's (one device runs the batches in turn), the
    tokens too."""
    from jaxllm.benchmarks.datasets import Request
    from jaxllm.benchmarks.hf_backend import run_hf

    python = _fake_hf_python(tmp_path)
    requests = [Request([1, 2], output_len=i + 1) for i in range(10)]  # batches of 4, 4, 2
    whole = run_hf(requests, hf_python=python, model=None, hf_config={}, dtype="float32",
                   batch_size=4, progress=False)
    assert whole["elapsed_s"] == 5.0 and whole["seen"] == list(range(1, 11))
    split = run_hf(requests, hf_python=python, model=None, hf_config={}, dtype="float32",
                   batch_size=4, progress=False, devices=["0", "1"])
    assert split["elapsed_s"] == whole["elapsed_s"]  # 6 + 4 requests at 0.5 s each
    assert split["generated_tokens"] == whole["generated_tokens"] == 55
    assert split["kv_slots_reserved"] == whole["kv_slots_reserved"] == 10 * 3
    assert split["peak_memory_bytes"] == 60 and split["wall_s"] > 0
    assert [(s["device"], s["num_requests"]) for s in split["shards"]] == [("0", 6), ("1", 4)]
    assert split["seen"] == [1, 2, 3, 4, 9, 10]  # device 0: batches 0 and 2, whole and in order


def test_hf_tuned_sorts_prompts_by_length_before_batching(tmp_path):
    from jaxllm.benchmarks.datasets import Request
    from jaxllm.benchmarks.hf_backend import run_hf

    requests = [Request((1,) * n, output_len=n) for n in (3, 9, 1, 7, 5)]
    r = run_hf(requests, variant="hf-tuned", hf_python=_fake_hf_python(tmp_path), model=None,
               hf_config={}, dtype="float32", batch_size=2, progress=False, devices=["0", "1"])
    assert r["variant"] == "hf-tuned" and r["widths"] == [9, 7, 1]  # batches [9 7] [5 3] [1]
    with pytest.raises(ValueError, match="variant"):
        run_hf(requests, variant="hf-fast", hf_python="python", model=None, hf_config={},
               dtype="float32", batch_size=2)


def test_throughput_fails_loudly_when_hf_produced_other_counts(tiny_config, tmp_path, capsys):
    out = tmp_path / "hf.json"
    rc = bench_main(["throughput", "--backend", "hf", *tiny_bench_args(tiny_config), "--hf-python",
                     _fake_hf_python(tmp_path, short=2), "--dataset-name", "random",
                     "--num-prompts", "4", "--input-len", "8", "--output-len", "5",
                     "--output-json", str(out)])
    assert rc == 2 and "hf produced 18 output tokens" in capsys.readouterr().err
    r = json.loads(out.read_text())["results"]["hf"]
    assert (r["total_output_tokens"], r["requested_output_tokens"]) == (18, 20)
    assert r["output_tokens_per_second"] == pytest.approx(18 / r["elapsed_time"])


@pytest.mark.parametrize("flag, value", [("--jax-static-batch-size", "0"),
                                         ("--jax-static-batch-size", "-2"),
                                         ("--hf-max-batch-size", "0")])
def test_throughput_refuses_a_static_batch_below_one(tiny_config, flag, value, capsys):
    with pytest.raises(SystemExit):
        bench_main(["throughput", *tiny_bench_args(tiny_config), "--backend", "jax-static",
                    "--num-prompts", "4", flag, value])
    assert f"argument {flag}: {value} must be >= 1" in capsys.readouterr().err
