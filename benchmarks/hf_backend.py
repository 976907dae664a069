"""The Hugging Face backends of ``bench throughput``, each in a separate interpreter
(``--hf-python``: the jaxllm venv has no torch), started with ``CUDA_VISIBLE_DEVICES`` so that
``--devices 0,1`` runs jaxllm and one of them side by side on a two-GPU machine.

``hf`` is vLLM's ``benchmark_throughput.py --backend hf``: prompts in the given order,
``--hf-max-batch-size`` at a time, left-padded, transformers' default attention and dynamic
cache; every row of a batch generates exactly the batch's longest output length
(``min_new_tokens = max_new_tokens``), sampled at temperature 1. ``hf-tuned`` and ``hf-cb``:
:mod:`benchmarks.hf_tuned`. One small warm-up batch runs before the clock starts.

What the child reports, the same for the three:

- ``generated_tokens``: counted from the returned ids: a row's tokens up to and including its
  first EOS (transformers pads a finished row), capped at the row's requested length. Rows that
  decode past their own length (a static batch runs to its longest) do waste, not output.
- ``kv_batches``: each static batch's layout (rows in the cache, padded width, decode steps, the
  static cache's length or None for the dynamic cache, real rows' prompt and requested output
  lengths), from which the parent computes KV waste with :mod:`jaxllm.engine.kv_usage`.
- peak memory: ``torch.cuda.memory_allocated()`` sampled during the timed run
  (:mod:`benchmarks.device_memory`), n/a on CPU; ``torch.cuda.max_memory_allocated`` since the
  warm-up as ``allocator_peak_bytes``.

This file is run as a script by the child interpreter beside copies of ``hf_tuned.py`` and
``device_memory.py``: stdlib imports only at the top; torch, transformers and the siblings are
imported inside :func:`child_main`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

VARIANTS = ("hf", "hf-tuned", "hf-cb")
CHILD_FILES = ("hf_backend.py", "hf_tuned.py", "device_memory.py")


def run_hf(requests, *, hf_python: str, model: str | None, hf_config: dict | None,
           dtype: str, batch_size: int, variant: str = "hf", n: int = 1, seed: int = 0,
           progress: bool = True, timeout: float | None = None,
           devices: list[str] | None = None, tuned_cache: str = "auto",
           cb_max_requests: int | None = None) -> dict:
    """Runs the child(ren); ``model`` (a HF directory, real weights) or ``hf_config`` (random
    weights of that shape). Returns the child's result dict (see :func:`child_main`) with the KV
    usage computed from its batches.

    hf-tuned sorts the requests by prompt length (longest first) before they are cut into
    batches. With several ``devices`` (CUDA ids), the batches are dealt round-robin to one child
    per device, run at the same time. Static batches are independent, so one device would take
    the sum of the children's times: ``elapsed_s`` is that sum (``wall_s`` is what the run
    took), and ``peak_memory_bytes`` the largest child's."""
    if variant not in VARIANTS:
        raise ValueError(f"{variant=} must be one of {VARIANTS}")
    if variant == "hf-tuned":
        requests = sorted(requests, key=lambda r: -r.prompt_len)
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    devices = list(devices or [None])[:max(1, len(batches))]
    # A shard keeps whole batches, in order, so its child cuts the same batches again.
    shards = [[r for b in batches[k::len(devices)] for r in b] for k in range(len(devices))]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # Run copies: from benchmarks/ the script's folder would shadow packages
        # (datasets, metrics) that transformers imports.
        here = os.path.dirname(os.path.abspath(__file__))
        for name in CHILD_FILES:
            shutil.copyfile(os.path.join(here, name), os.path.join(tmp, name))
        script = os.path.join(tmp, "hf_backend.py")
        children = []
        for k, (device, shard) in enumerate(zip(devices, shards, strict=True)):
            src, dst = os.path.join(tmp, f"job{k}.json"), os.path.join(tmp, f"result{k}.json")
            job = {"variant": variant, "requests": [[list(r.prompt_ids), r.output_len]
                                                    for r in shard],
                   "model": model, "hf_config": hf_config, "dtype": dtype,
                   "batch_size": batch_size, "n": n, "seed": seed + k,
                   "progress": progress and k == 0, "tuned_cache": tuned_cache,
                   "cb_max_requests": cb_max_requests}
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
                raise RuntimeError(f"{variant} backend ({hf_python}) exited with "
                                   f"{proc.returncode}: {(out or '')[-2000:]}")
            with open(dst) as f:
                results.append(json.load(f))
    combined = dict(results[0])
    if len(results) > 1:
        peaks = [r["peak_memory_bytes"] for r in results if r["peak_memory_bytes"] is not None]
        combined.update(
            elapsed_s=sum(r["elapsed_s"] for r in results),
            wall_s=time.perf_counter() - start,
            peak_memory_bytes=max(peaks) if peaks else None,
            generated_tokens=sum(r["generated_tokens"] for r in results),
            decoded_tokens=sum(r["decoded_tokens"] for r in results),
            kv_batches=None if results[0]["kv_batches"] is None
            else [b for r in results for b in r["kv_batches"]],
            shards=[{"device": d, "num_requests": len(s), "elapsed_s": r["elapsed_s"],
                     "peak_memory_bytes": r["peak_memory_bytes"]}
                    for d, s, r in zip(devices, shards, results, strict=True)])
    combined.update(hf_kv_usage(combined.pop("kv_batches")))
    return combined


def hf_kv_usage(kv_batches: list | None) -> dict:
    """KV usage (:mod:`jaxllm.engine.kv_usage`) of a child's static batches: each is [rows in
    the cache, padded prompt width, decode steps, static cache length or None (dynamic cache),
    real rows' prompt lengths, their requested output lengths]."""
    from jaxllm.engine.kv_usage import KVUsage, contiguous_batch

    if kv_batches is None:
        return KVUsage().as_dict() | {"kv_note": "paged cache inside transformers: its block "
                                                 "tables are not visible from outside"}
    usage = KVUsage()
    for rows, width, steps, cache_len, prompt_lens, output_lens in kv_batches:
        usage += contiguous_batch(prompt_lens, output_lens, steps, rows=rows, width=width,
                                  cache_len=cache_len)
    return usage.as_dict()


def count_generated(new_ids: list[list[int]], requested: list[int],
                    eos_ids: set[int]) -> list[int]:
    """Output tokens row i produced, from the ids ``generate()`` returned after the prompt: up to
    and including its first EOS (the rest is padding), capped at ``requested[i]``."""
    counts = []
    for ids, want in zip(new_ids, requested, strict=True):
        produced = next((j + 1 for j, t in enumerate(ids) if t in eos_ids), len(ids))
        counts.append(min(produced, want))
    return counts


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    eos = model.config.eos_token_id if eos is None else eos
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def load_model(job: dict, device: str, attn_implementation: str | None):
    import torch
    import transformers

    dtype = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16, "auto": "auto"}[job["dtype"]]
    torch.manual_seed(job["seed"])
    attn = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if job["model"] is not None and job["hf_config"] is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            job["model"], dtype=dtype, device_map=device, **attn)
    else:
        cfg = transformers.AutoConfig.for_model(**job["hf_config"])
        with torch.device(device):  # random init straight on the device (fast for 8B)
            model = transformers.AutoModelForCausalLM.from_config(
                cfg, dtype=torch.float32 if dtype == "auto" else dtype, **attn)
    return model.eval()


def static_batch(model, batch, *, n: int, device: str, pad: int = 0, rows: int | None = None,
                 **generate_kwargs):
    """One left-padded ``generate()`` call: every row decodes the batch's longest output. Pads
    the batch to ``rows`` rows with copies of its first request (a static cache's fixed shape).
    Returns (the generated ids after the prompt, width, the decode steps it ran)."""
    import torch

    batch = list(batch) + [batch[0]] * ((rows or len(batch)) - len(batch))
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
        min_new_tokens=new, pad_token_id=pad, use_cache=True, **generate_kwargs)
    return out[:, width:], width, out.shape[1] - width  # the decode steps that ran


def run_static_batches(model, requests, job, device, *, rows=None, cache_len=None,
                       **generate_kwargs) -> dict:
    """The timed loop over static batches (``hf`` and hf-tuned's static batching): sampled peak
    memory, produced tokens counted from the returned ids after the clock, each batch's layout."""
    import torch
    from device_memory import PeakSampler
    from tqdm.auto import tqdm

    n, size = job["n"], job["batch_size"]
    cuda = device == "cuda"
    outputs = []
    with PeakSampler(torch.cuda.memory_allocated if cuda else lambda: None) as memory, \
            tqdm(total=len(requests), desc=job["variant"], unit="req", file=sys.stderr,
                 disable=not job["progress"]) as bar:
        start = time.perf_counter()
        for i in range(0, len(requests), size):
            batch = requests[i:i + size]
            outputs.append((batch, *static_batch(model, batch, n=n, device=device, rows=rows,
                                                 **generate_kwargs)))
            bar.update(len(batch))
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    eos, generated, decoded, layout = _eos_ids(model), 0, 0, []
    for batch, new_ids, width, steps in outputs:
        wanted = [o for _, o in batch for _ in range(n)]  # row i*n + j: request i, sample j
        generated += sum(count_generated(new_ids[:len(wanted)].tolist(), wanted, eos))
        decoded += new_ids.shape[0] * new_ids.shape[1]
        layout.append([new_ids.shape[0], width, steps, cache_len,
                       [len(p) for p, _ in batch for _ in range(n)], wanted])
    return {"elapsed_s": elapsed, "generated_tokens": generated, "decoded_tokens": decoded,
            "kv_batches": layout, "num_batches": len(outputs),
            **memory.result("torch.cuda.memory_allocated")}


def child_main(src: str, dst: str) -> None:
    import torch
    import transformers
    from device_memory import host_peak_rss_bytes

    with open(src) as f:
        job = json.load(f)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    variant, requests = job["variant"], job["requests"]
    # hf-cb's generation thread updates its cache outside inference mode: no_grad there.
    with torch.inference_mode() if variant != "hf-cb" else torch.no_grad():
        if variant == "hf":
            model = load_model(job, device, None)  # transformers' default attention
            warm_start = time.perf_counter()
            static_batch(model, [(requests[0][0][:16], 2)], n=job["n"], device=device)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            warm_up = time.perf_counter() - warm_start
            result = run_static_batches(model, requests, job, device) | {"cache": "dynamic"}
        else:
            import hf_tuned

            model = load_model(job, device, "sdpa")
            run = hf_tuned.run_tuned if variant == "hf-tuned" else hf_tuned.run_cb
            result = run(model, requests, job, device, sys.modules[__name__])
            warm_up = result.pop("warm_up_s")
    result |= {
        "warm_up_s": warm_up, "device": torch.cuda.get_device_name() if device == "cuda"
        else "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
        "batch_size": job["batch_size"], "host_peak_rss_bytes": host_peak_rss_bytes()}
    if device == "cuda":
        result["allocator_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    with open(dst, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])
