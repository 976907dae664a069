"""``python -m jaxllm.benchmarks.launch_anatomy``: what the host spends launching one step of
a large model, split by what the executable holds.

Why: the 8B forward's call holds the host ~3.3 ms before it returns (RESULTS.md, "What an
executable call costs the host"), so small steps (batch-1 decode, the long tail of an
offline run, AWQ at batch 1) are bound by the launch, not by the device. Whether that is the
~260 arguments, the ~600 kernels, or the Pallas calls inside the command buffers decides the
fix. Each variant is one jitted step (forward + greedy sample, the pool donated) of the model
with dummy weights, timed per call: ``launch`` = until the call returns (the host's cost),
``step`` = until its tokens are ready, and the same for calls made back to back without
waiting (``b2b``: the engine's async steps; ``b2b step`` = wall / calls, the larger of the
host's and the device's cost). Every call gets a fresh batch buffer, as an engine step does.
``XLA_FLAGS`` (in the JSON) selects XLA's command-buffer modes to compare. Variants
(``--variants``):

- ``unrolled``: the engine's GPU layout (per-layer params and pool) with the Pallas kernels;
- ``unrolled-xla-attention``: the same with XLA's reference attention (no Pallas calls);
- ``stacked``: layers stacked and scanned (a loop in one executable, ~30 arguments);
- ``args-only``: an executable taking the unrolled step's arguments and doing one tiny op
  (the cost of handing ~260 device buffers to an executable, nothing else).

``--batch-buffer fresh,same`` times each variant also with the same batch buffer every call
(the step's input at one address: XLA re-records no graph for it), ``--quantization awq`` the
AWQ model. Before each timed case a line "### VARIANT BUCKET BUFFER" goes to stderr, so that a
run under ``TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3`` gives
``command_buffer_log`` XLA's graph updates case by case.

Printed per variant and bucket: the HLO's fusion and custom-call counts, launch and step ms
(medians); the JSON holds every figure.

    python -m jaxllm.benchmarks.launch_anatomy --buckets 1x1,256x1 --output-json launch.json
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import numpy as np

VARIANTS = ("unrolled", "unrolled-xla-attention", "stacked", "args-only")


def _step(model, seqs: int, context: int, block_size: int, attention: str):
    """A decode step of ``seqs`` sequences after ``context`` cached tokens: the jitted
    function, its pool and its batch (as ``fp8_compile_time``'s, with a chosen attention)."""
    import jax

    from jaxllm import SeqChunk, make_forward, new_kv_pool, pack_batch
    from jaxllm.sampler_rows import build_sampling_metadata
    from jaxllm.sampling import sample

    cfg = model.config
    per_seq = -(-(context + 1) // block_size)
    pool = new_kv_pool(cfg, 1 + seqs * per_seq, block_size, model.dtype,
                       unroll_layers=model.unroll_layers, mesh=model.mesh)
    chunks = [SeqChunk([100 + i % 50], context, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
              for i in range(seqs)]
    batch = jax.device_put(pack_batch(chunks, block_size))
    forward = make_forward(cfg, model.dtype, attention, model.mesh)
    greedy = build_sampling_metadata([], seqs, 0, 0)

    def step(params, kv_pool, batch):
        logits, kv_pool = forward(params, kv_pool, batch)
        return sample(logits, greedy, all_greedy=True, use_top_k_top_p=False).sampled, kv_pool

    return jax.jit(step, donate_argnums=(1,)), pool, batch


def _args_only():
    import jax

    def touch(params, kv_pool, batch):
        del params, kv_pool
        return jax.tree.leaves(batch)[0] + 1

    return jax.jit(touch)


def _time(exe, args: list, iters: int, donate: bool, fresh_batches: bool = True) -> dict:
    """Median launch and step ms of calls made one at a time, the launch and per-step ms of
    calls made back to back (as the engine's async steps are), and the first call's tokens.
    ``args[1]`` (the pool) is replaced by the donated output; every call gets a freshly
    transferred batch, as every engine step does (a new buffer address each call, which
    XLA's command buffers must be updated for), or with ``fresh_batches=False`` the same
    batch buffer every call (what a step input kept at a fixed address would give)."""
    import jax

    host_batch = jax.device_get(args[2])
    fresh = ([jax.device_put(host_batch) for _ in range(2 * iters + 3)] if fresh_batches
             else [args[2]] * (2 * iters + 3))
    launches, steps, first = [], [], None
    for i in range(iters + 3):
        args[2] = fresh.pop()
        jax.block_until_ready(args)
        t = time.perf_counter()
        out = exe(*args)
        launched = time.perf_counter()
        jax.block_until_ready(out)
        done = time.perf_counter()
        if first is None:
            first = np.asarray(out[0] if donate else out).ravel().tolist()
        if donate:
            args[1] = out[1]
        if i >= 3:
            launches.append(launched - t)
            steps.append(done - t)
    jax.block_until_ready(fresh)
    back_to_back, outs = [], []
    start = time.perf_counter()
    for _ in range(iters):
        args[2] = fresh.pop()
        t = time.perf_counter()
        out = exe(*args)
        back_to_back.append(time.perf_counter() - t)
        outs.append(out[0] if donate else out)
        if donate:
            args[1] = out[1]
    jax.block_until_ready(outs)
    wall = time.perf_counter() - start
    return {"launch_ms": 1e3 * float(np.median(launches)),
            "step_ms": 1e3 * float(np.median(steps)),
            "back_to_back_launch_ms": 1e3 * float(np.median(back_to_back)),
            "back_to_back_step_ms": 1e3 * wall / iters, "first_tokens": first[:64]}


def _hlo_counts(exe) -> dict:
    text = exe.as_text()
    return {"fusions": len(re.findall(r" fusion\(", text)),
            "custom_calls": len(re.findall(r" custom-call\(", text)),
            "whiles": len(re.findall(r" while\(", text))}


def run(args) -> dict:
    import jax
    from jaxllm.benchmarks.provenance import source_commit, write_json

    import jaxllm

    result = {"commit": source_commit(), "model": args.model, "context_len": args.context_len,
              "quantization": args.quantization, "gemv_overrides": args.gemv_overrides,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "devices": [str(d) for d in jax.devices()], "rows": []}
    if args.gemv_overrides:
        from jaxllm.benchmarks.step_profile import override_gemv

        override_gemv(args.gemv_overrides)  # (its cache directory: unused, nothing cached here)
    if not set(args.batch_buffer.split(",")) <= {"fresh", "same"}:
        raise ValueError(f"--batch-buffer: {args.batch_buffer!r} is not fresh and/or same")
    variants = args.variants.split(",")
    for name in variants:
        if name not in VARIANTS:
            raise ValueError(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
    print(f"{'variant':<24}{'bucket':>8}{'args':>6}{'fusions':>9}{'calls':>7}{'whiles':>8}"
          f"{'launch ms':>11}{'step ms':>10}{'b2b launch':>12}{'b2b step':>10}", flush=True)
    for unrolled in (True, False):
        names = [n for n in variants if (n == "stacked") != unrolled]
        if not names:
            continue
        model = jaxllm.load_model(args.model, dtype="bfloat16", load_format="dummy",
                                  unroll_layers=unrolled, quantization=args.quantization)
        jax.block_until_ready(model.params)
        for bucket in args.buckets.split(","):
            seqs = int(bucket.split("x")[0])
            for name in names:
                attention = "reference" if name == "unrolled-xla-attention" else "auto"
                fn, pool, batch = _step(model, seqs, args.context_len, args.block_size,
                                        attention)
                call_args = [model.params, pool, batch]
                exe = (_args_only() if name == "args-only" else fn).lower(*call_args).compile()
                for buffer in args.batch_buffer.split(","):
                    # a section of XLA's log for command_buffer_log (TF_CPP_VMODULE runs)
                    print(f"### {name} {bucket} {buffer}", file=sys.stderr, flush=True)
                    timed = _time(exe, call_args, args.iters, name != "args-only",
                                  fresh_batches=buffer == "fresh")
                    row = {"variant": name, "bucket": bucket, "batch_buffer": buffer, **timed,
                           "num_args": len(jax.tree.leaves(call_args)), **_hlo_counts(exe)}
                    result["rows"].append(row)
                    write_json(result, args.output_json)
                    print(f"{name + ' ' + buffer:<24}{bucket:>8}{row['num_args']:>6}"
                          f"{row['fusions']:>9}{row['custom_calls']:>7}{row['whiles']:>8}"
                          f"{row['launch_ms']:>11.3f}{row['step_ms']:>10.3f}"
                          f"{row['back_to_back_launch_ms']:>12.3f}"
                          f"{row['back_to_back_step_ms']:>10.3f}", flush=True)
                del call_args, pool, exe
        del model
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--buckets", default="1x1,256x1",
                        help="SEQSx1: a decode step of SEQS sequences")
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quantization", default=None, help="as the engine's (awq, fp8, ...)")
    parser.add_argument("--gemv-overrides", default=None,
                        help="int4 GEMV config fields over every config it picks, as "
                             "step_profile's (e.g. x_in_kernel=True)")
    parser.add_argument("--batch-buffer", default="fresh",
                        help="comma-separated: fresh (a newly transferred batch every call, as "
                             "the engine's steps), same (the same device buffer every call)")
    parser.add_argument("--output-json", default=None)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
