"""The ``hf`` backend of ``bench throughput``: transformers + torch ``generate()`` in static
batches, in a separate interpreter (``--hf-python``), since the jaxllm venv has no torch.

Static batching as in vLLM's ``benchmark_throughput.py --backend hf``: prompts in the given
order, ``--hf-max-batch-size`` at a time, left-padded; every row of a batch generates exactly
the batch's longest output length (``min_new_tokens = max_new_tokens``), sampled at temperature
1. Useful output tokens are the requested lengths, so padding and stragglers count as waste.
One small warm-up batch runs before the clock starts. Peak memory:
``torch.cuda.max_memory_allocated`` on CUDA, the process's peak RSS on CPU.

This file is run as a script by the child interpreter: stdlib imports only at the top; torch
and transformers are imported inside :func:`child_main`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def run_hf(requests, *, hf_python: str, model: str | None, hf_config: dict | None,
           dtype: str, batch_size: int, n: int = 1, seed: int = 0,
           progress: bool = True, timeout: float | None = None,
           devices: list[str] | None = None) -> dict:
    """Runs the child; ``model`` (a HF directory, real weights) or ``hf_config`` (random
    weights of that shape). Returns the child's result dict (see :func:`child_main`).

    With several ``devices`` (CUDA ids), the static batches are dealt round-robin to one child
    per device, run at the same time. Static batches are independent, so one device would take
    the sum of the children's times: ``elapsed_s`` is that sum (``wall_s`` is what the run
    took), and ``peak_memory_bytes`` the largest child's."""
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    devices = list(devices or [None])[:max(1, len(batches))]
    # A shard keeps whole batches, in order, so its child cuts the same batches again.
    shards = [[r for b in batches[k::len(devices)] for r in b] for k in range(len(devices))]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # Run a copy: from benchmarks/ the script's folder would shadow packages
        # (datasets, metrics) that transformers imports.
        script = os.path.join(tmp, "hf_backend_child.py")
        shutil.copyfile(os.path.abspath(__file__), script)
        children = []
        for k, (device, shard) in enumerate(zip(devices, shards, strict=True)):
            src, dst = os.path.join(tmp, f"job{k}.json"), os.path.join(tmp, f"result{k}.json")
            job = {"requests": [[list(r.prompt_ids), r.output_len] for r in shard],
                   "model": model, "hf_config": hf_config, "dtype": dtype,
                   "batch_size": batch_size, "n": n, "seed": seed + k,
                   "progress": progress and k == 0}
            with open(src, "w") as f:
                json.dump(job, f)
            env = dict(os.environ) | ({} if device is None else {"CUDA_VISIBLE_DEVICES": device})
            children.append((subprocess.Popen([hf_python, script, src, dst], env=env,
                                              stdout=subprocess.PIPE, text=True), dst))
        results = []
        for proc, dst in children:
            try:
                out, _ = proc.communicate(
                    timeout=None if timeout is None
                    else max(1.0, timeout - (time.perf_counter() - start)))
            except subprocess.TimeoutExpired:
                for other, _ in children:
                    other.kill()
                raise
            if proc.returncode != 0:
                for other, _ in children:
                    other.kill()
                raise RuntimeError(f"hf backend ({hf_python}) exited with {proc.returncode}: "
                                   f"{(out or '')[-2000:]}")
            with open(dst) as f:
                results.append(json.load(f))
    if len(results) == 1:
        return results[0]
    combined = dict(results[0])
    combined.update(
        elapsed_s=sum(r["elapsed_s"] for r in results),
        wall_s=time.perf_counter() - start,
        peak_memory_bytes=max(r["peak_memory_bytes"] for r in results),
        shards=[{"device": d, "num_requests": len(s), "elapsed_s": r["elapsed_s"],
                 "peak_memory_bytes": r["peak_memory_bytes"]}
                for d, s, r in zip(devices, shards, results, strict=True)])
    return combined


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child_main(src: str, dst: str) -> None:
    import torch
    import transformers
    from tqdm.auto import tqdm

    with open(src) as f:
        job = json.load(f)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16, "auto": "auto"}[job["dtype"]]
    torch.manual_seed(job["seed"])
    if job["model"] is not None and job["hf_config"] is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            job["model"], dtype=dtype, device_map=device)
    else:
        cfg = transformers.AutoConfig.for_model(**job["hf_config"])
        with torch.device(device):  # random init straight on the device (fast for 8B)
            model = transformers.AutoModelForCausalLM.from_config(
                cfg, dtype=torch.float32 if dtype == "auto" else dtype)
    model.eval()
    requests = job["requests"]
    batch_size, n = job["batch_size"], job["n"]
    pad = 0

    def run_batch(batch):
        width = max(len(p) for p, _ in batch)
        new = max(o for _, o in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding, as generate() expects
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
            temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=n, max_new_tokens=new,
            min_new_tokens=new, pad_token_id=pad, use_cache=True)
        return out.shape[1] - width

    with torch.inference_mode():
        run_batch([(requests[0][0][:16], 2)])  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with tqdm(total=len(requests), desc="hf generate", unit="req", file=sys.stderr,
                  disable=not job["progress"]) as bar:
            for i in range(0, len(requests), batch_size):
                batch = requests[i:i + batch_size]
                run_batch(batch)
                bar.update(len(batch))
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if device == "cuda" else _peak_rss_bytes())
    result = {
        "elapsed_s": elapsed, "device": torch.cuda.get_device_name() if device == "cuda"
        else "cpu", "peak_memory_bytes": int(peak),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if device == "cuda"
        else "process peak RSS",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "batch_size": batch_size,
    }
    with open(dst, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])
