"""``bench throughput``'s Hugging Face backends on CPU at tiny sizes: hf beside jaxllm in one
run, the static-batch loop's token counts, hf-tuned and hf-cb, batches dealt to devices, and
a loud failure when a backend produced other counts than asked.

They run in the reference venv (``make fixtures`` builds ``.venv-ref``: Python 3.11, CPU torch,
transformers; ``JAXLLM_REF_PYTHON`` names another interpreter), or against a fake interpreter
that stands in for torch; tests that need the venv say so when they skip."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

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
