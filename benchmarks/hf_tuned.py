"""The tuned Hugging Face baselines of ``bench throughput``: ``hf-tuned`` (static batching done
as well as transformers allows) and ``hf-cb`` (transformers' own continuous batching). Run in
the hf child interpreter (:mod:`benchmarks.hf_backend`, which counts and reports the same way
for every variant); stdlib imports only at the top.

``hf-tuned``:

- Prompts sorted by length, longest first, then cut into batches of ``--hf-max-batch-size``
  (the parent sorts, so ``--hf-devices`` deals sorted batches): a batch's prompts have similar
  lengths, so little of its prefill and cache is padding. The sort key is the prompt, not the
  output length: a deployment knows its prompts but not how long each answer will be (sorting by
  requested output would be an oracle no real server has). Each batch generates its longest
  requested output (``max_new_tokens``); rows finishing early decode on as waste, not output.
- ``attn_implementation="sdpa"`` (torch's fused attention).
- ``--hf-tuned-cache static-compile`` (the default on CUDA): a static KV cache, whose decode
  step transformers compiles with ``torch.compile`` (mode ``reduce-overhead``: CUDA graphs),
  which removes the per-step host overhead that bounds ``hf`` (~100 ms a step at any batch on
  the H200). One shape for the whole run, on both workloads: every batch has ``batch_size`` rows
  (the last one padded with copies of a prompt) and a cache of ``max(width + new)`` over the
  batches, because transformers itself never shrinks a static cache between calls
  (``generate`` keeps the longest seen, to avoid recompiling). So the fixed random 512/128
  workload has no waste from it, and the variable sharegpt-like one trades the slots of shorter
  batches' caches (counted as KV waste) for one compilation and no per-step host overhead. The
  alternative, a few cache-length buckets, would compile once per bucket inside a device budget
  that cannot afford it, and transformers would still keep the longest cache. The decode graphs
  are compiled and recorded before the clock, on a batch of the timed shape.
- ``static``: the same static cache, eager; ``dynamic``: transformers' growing cache (the default
  off CUDA, where ``generate`` does not compile).

``hf-cb``: the manager behind ``model.generate_batch`` (``continuous_batching_context_manager``,
paged cache, transformers' own sizing from ``WorkloadHints`` as ``generate_batch`` builds them),
with every request added at once with its own ``max_new_tokens`` and EOS off, as the other
backends run (``generate_batch`` takes one ``max_new_tokens`` for all requests). Output tokens
are counted from each result's ``generated_tokens``. Its block tables stay inside transformers,
so its KV waste is not reported. ``n = 1`` only. Off CUDA (the CPU tests) its pool is sized to
the workload (transformers would take the host's whole memory).
"""

from __future__ import annotations

import sys
import time

TUNED_CACHES = ("auto", "static-compile", "static", "dynamic")


def resolve_cache(setting: str, device: str) -> str:
    """The cache hf-tuned runs with: ``auto`` is static-compile on CUDA, dynamic elsewhere;
    ``generate()`` compiles on CUDA only, so static-compile elsewhere runs static."""
    if setting not in TUNED_CACHES:
        raise ValueError(f"{setting=} must be one of {TUNED_CACHES}")
    if setting == "auto":
        return "static-compile" if device == "cuda" else "dynamic"
    return "static" if setting == "static-compile" and device != "cuda" else setting


def _graphs() -> int:
    """torch.compile's graphs so far (to show compilations during the timed run)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a private counter; absent is fine
        return -1


def run_tuned(model, requests, job, device, hf) -> dict:
    """``hf``: the hf_backend module (its static_batch and run_static_batches)."""
    import torch

    cache = resolve_cache(job["tuned_cache"], device)
    size, n = job["batch_size"], job["n"]
    batches = [requests[i:i + size] for i in range(0, len(requests), size)]
    rows = cache_len = None
    kwargs: dict = {}
    if cache != "dynamic":
        rows = size if len(batches) > 1 else len(batches[0])
        cache_len = max(max(len(p) for p, _ in b) + max(o for _, o in b) for b in batches)
        kwargs = {"cache_implementation": "static", "max_cache_len": cache_len,
                  "disable_compile": cache == "static"}
    start = time.perf_counter()
    # Warm-up at the timed shape: rows x cache_len (compiles and records the decode step).
    for _ in range(2 if cache == "static-compile" else 1):
        hf.static_batch(model, [(requests[0][0][:16], 8)], n=n, device=device, rows=rows,
                        **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warm_up = time.perf_counter() - start
    graphs = _graphs()
    result = hf.run_static_batches(model, requests, job, device, rows=rows,
                                   cache_len=cache_len, **kwargs)
    return result | {"warm_up_s": warm_up, "cache": cache, "sorted_by": "prompt length",
                     "static_cache_len": cache_len,
                     "compiled": cache == "static-compile" and hasattr(model, "_compiled_call"),
                     "graphs_compiled_during_run": _graphs() - graphs}


def _collect(manager, requests, bar=None) -> list:
    """Adds every (prompt, output length) request at once; returns their finished outputs in
    order. Raises when the manager drops or fails one."""
    ids = [manager.add_request(list(p), max_new_tokens=o, eos_token_id=-1) for p, o in requests]
    if None in ids:
        raise RuntimeError("hf-cb: the manager refused a request")
    done: dict = {}
    while len(done) < len(ids):
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"hf-cb: request {out.request_id} failed: {out.error}")
            done[out.request_id] = out
            if bar is not None:
                bar.update(1)
        elif out is None and not manager.is_running():
            raise RuntimeError(f"hf-cb: the generation thread stopped with {len(ids) - len(done)}"
                               f" requests unfinished")
    return [done[i] for i in ids]


def run_cb(model, requests, job, device, hf=None) -> dict:
    import torch
    from device_memory import PeakSampler
    from tqdm.auto import tqdm
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    if job["n"] != 1:
        raise ValueError("hf-cb runs n = 1 only")
    longest = max(o for _, o in requests)
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=longest, eos_token_id=-1, pad_token_id=0)
    sizes: dict = {} if job["cb_max_requests"] is None else {
        "max_requests_per_batch": job["cb_max_requests"]}
    if device != "cuda":  # transformers would size the cache from the host's whole memory
        block = ContinuousBatchingConfig.block_size
        sizes |= {"num_blocks": 2 + sum(-(-(len(p) + o) // block) for p, o in requests),
                  "max_batch_tokens": 512}
    cb = ContinuousBatchingConfig(**sizes)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in requests),
                          max_generated_length=longest, num_requests=len(requests))
    cuda = device == "cuda"
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True, timeout=5,
            workload_hints=hints) as manager:
        _collect(manager, [(requests[0][0][:16], 4)] * 2)  # warm-up (graphs captured on entry)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        warm_up = time.perf_counter() - start
        with PeakSampler(torch.cuda.memory_allocated if cuda else lambda: None) as memory, \
                tqdm(total=len(requests), desc="hf-cb", unit="req", file=sys.stderr,
                     disable=not job["progress"]) as bar:
            start = time.perf_counter()
            outs = _collect(manager, requests, bar)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        resolved = manager.continuous_batching_config
        config = {k: v for k, v in vars(resolved).items()
                  if isinstance(v, (int, float, str, bool, type(None)))}
    produced = [len(o.generated_tokens) for o in outs]
    return {"elapsed_s": elapsed, "warm_up_s": warm_up, "cache": "paged (continuous batching)",
            "generated_tokens": sum(min(p, o) for p, (_, o) in zip(produced, requests,
                                                                    strict=True)),
            "decoded_tokens": sum(produced), "kv_batches": None, "cb_config": config,
            **memory.result("torch.cuda.memory_allocated")}
