"""How much of a step the shape buckets pad, against how many programs they cost (CPU only).

A model of the engine's loop (fcfs, chunked prefill, KV blocks unlimited: the scheduler's
token and sequence budgets only) runs a workload and records each step's real size; each
candidate ladder of buckets then pads those steps. Two wastes are reported:

- ``rows``: padded rows (decode) or tokens (mixed steps) over the real ones;
- ``time``: the padding's cost under a roofline step model, ``t(n) = max(memory_ms,
  n x ms_per_token)``: a step reads all weights however small it is, and past
  ``memory_ms / ms_per_token`` rows (~146 for the Llama-3-8B shape on an H200: 16 GB of bf16
  weights at 4.8 TB/s = 3.35 ms; 16 GFLOP a token at ~700 TFLOP/s = 0.023 ms) each padded row
  costs as much as a real one. Attention is left out: a padded row has no context to read.

The step model's two constants are assumptions (flags), not measurements; the workload is
``jaxllm.benchmarks.datasets``' (sharegpt-like by default, 1000 prompts, offline: all arrive
at once; ``--request-rate`` spaces them as a Poisson process, with time advancing by the
modelled step time). Prints a table and writes JSON::

    python -m jaxllm.benchmarks.bucket_padding --output-json bucket_padding.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import numpy as np
from jaxllm.benchmarks.datasets import sample_requests

from jaxllm.engine.buckets import BucketSpec, batch_sizes, token_sizes


def simulate(prompt_lens, output_lens, max_num_seqs: int, max_num_batched_tokens: int, *,
             arrivals=None, step_ms=None) -> tuple[collections.Counter, collections.Counter]:
    """(decode-only steps by row count, mixed steps by token count) of the engine's loop
    over these requests: running sequences first (1 token when decoding, else a chunk),
    then waiting ones admitted in order while tokens and seats last."""
    n = len(prompt_lens)
    arrivals = np.zeros(n) if arrivals is None else arrivals
    decode, mixed = collections.Counter(), collections.Counter()
    computed = {}  # running request -> tokens computed (prompt first, then outputs)
    next_req, now, done = 0, 0.0, 0
    while done < n:
        budget, tokens, prefilling = max_num_batched_tokens, 0, False
        for r in list(computed):
            need = prompt_lens[r] - computed[r] if computed[r] < prompt_lens[r] else 1
            take = min(need, budget)
            if take == 0:
                break
            prefilling |= computed[r] < prompt_lens[r]
            computed[r] += take
            budget -= take
            tokens += take
        while (budget > 0 and next_req < n and arrivals[next_req] <= now
               and len(computed) < max_num_seqs):
            take = min(prompt_lens[next_req], budget)
            computed[next_req] = take
            budget -= take
            tokens += take
            prefilling = True
            next_req += 1
        if tokens == 0:  # idle until the next arrival
            now = arrivals[next_req]
            continue
        (mixed if prefilling else decode)[tokens] += 1
        now += step_ms(tokens) / 1e3 if step_ms else 0.0
        for r in list(computed):
            if computed[r] >= prompt_lens[r] + output_lens[r] - 1:  # its last token sampled
                del computed[r]
                done += 1
    return decode, mixed


def _bucket(ladder: tuple[int, ...], size: int) -> int:
    return ladder[int(np.searchsorted(ladder, size))]  # the smallest that holds it


def padding(steps: collections.Counter, ladder: tuple[int, ...], step_ms) -> dict:
    """Padded rows over real ones, and the modelled time padding adds over the steps' time."""
    real = sum(k * c for k, c in steps.items())
    padded = time = padded_time = 0.0
    for k, c in steps.items():
        bucket = _bucket(ladder, k)
        padded += (bucket - k) * c
        time += step_ms(k) * c
        padded_time += (step_ms(bucket) - step_ms(k)) * c
    return {"buckets": len(ladder), "row_waste": padded / max(real, 1),
            "time_waste": padded_time / max(time, 1e-9), "steps": sum(steps.values())}


def powers_of_two(hi: int, lo: int = 1) -> tuple[int, ...]:
    return tuple(sorted({*(1 << i for i in range(lo.bit_length() - 1, hi.bit_length())
                           if lo <= 1 << i < hi), hi}))


def linear_after(powers_to: int, step: int):
    return lambda hi: tuple(sorted({*powers_of_two(min(powers_to, hi)),
                                    *range(powers_to, hi, step), hi}))


def old_token_sizes(hi: int) -> tuple[int, ...]:  # jaxllm.engine.buckets before issue 17
    step = 256 * max(1, -(-hi // (8 * 256)))
    return tuple(sorted({*powers_of_two(min(step, hi), min(16, hi)), *range(step, hi, step),
                         hi}))


DECODE_LADDERS = {
    "powers of two (before)": powers_of_two,
    "powers to 128, every 128": linear_after(128, 128),
    "powers to 128, every 64": linear_after(128, 64),
    "jaxllm.engine.buckets": batch_sizes,
}
TOKEN_LADDERS = {
    "before": old_token_sizes,
    "jaxllm.engine.buckets": token_sizes,
}
SAMPLER_VARIANTS = 3  # model_runner.WARM_SAMPLER_VARIANTS (6 with a tokenizer: + bitmask)


def programs(spec: BucketSpec) -> dict:
    """What warm-up compiles for these buckets (one table width: the GPU kernels'): a forward
    per step shape and the sampler variants per row count (ModelRunner.warm_up)."""
    shapes = spec.all_shapes()
    rows = {s.num_seqs for s in shapes}
    return {"forwards": len(shapes), "sampler_row_counts": len(rows),
            "programs": len(shapes) + SAMPLER_VARIANTS * len(rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset-name", default="sharegpt-like")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--limits", default="256x2048,1024x8192,1024x16384",
                   help="max_num_seqs x max_num_batched_tokens pairs, comma separated")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--memory-ms", type=float, default=3.35,
                   help="the step model's floor: all weights read once (ms)")
    p.add_argument("--ms-per-token", type=float, default=0.023,
                   help="the step model's compute cost of one token (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    reqs = sample_requests(args.dataset_name, args.num_prompts, 128256, seed=args.seed,
                           input_len=args.input_len, output_len=args.output_len)
    prompt_lens = np.array([r.prompt_len for r in reqs])
    output_lens = np.array([r.output_len for r in reqs])
    rng = np.random.default_rng(args.seed)
    arrivals = (None if args.request_rate == float("inf") else
                np.cumsum(rng.exponential(1 / args.request_rate, len(reqs))))

    def step_ms(n: int) -> float:
        return max(args.memory_ms, n * args.ms_per_token)

    results, compiles = [], []
    for pair in args.limits.split(","):
        seqs, tokens = (int(x) for x in pair.split("x"))
        old = BucketSpec(powers_of_two(seqs), old_token_sizes(tokens), (512,))
        new = BucketSpec.build(seqs, tokens, 512, False)
        for name, spec in (("before", old), ("now", new)):
            compiles.append({"limits": pair, "buckets": name, **programs(spec)})
        decode, mixed = simulate(prompt_lens, output_lens, seqs, tokens, arrivals=arrivals,
                                 step_ms=step_ms)
        for kind, steps, ladders, hi in (("decode", decode, DECODE_LADDERS, seqs),
                                         ("mixed", mixed, TOKEN_LADDERS, tokens)):
            for name, ladder in ladders.items():
                row = {"limits": pair, "kind": kind, "ladder": name,
                       **padding(steps, ladder(hi), step_ms)}
                results.append(row)
                print(f"{pair:>11} {kind:6} {name:26} {row['buckets']:3d} buckets  "
                      f"rows +{100 * row['row_waste']:5.1f}%  time +"
                      f"{100 * row['time_waste']:5.1f}%  ({row['steps']} steps)")
        # Every step (decode and mixed) as each BucketSpec pads it, in the step model's ms.
        total = {name: sum(step_ms(_bucket(spec.batch_sizes, k)) * c for k, c in decode.items())
                 + sum(step_ms(_bucket(spec.token_sizes, k)) * c for k, c in mixed.items())
                 for name, spec in (("before", old), ("now", new))}
        unpadded = sum(step_ms(k) * c for steps in (decode, mixed) for k, c in steps.items())
        results.append({"limits": pair, "kind": "all", "modelled_ms": total,
                        "unpadded_ms": unpadded})
        print(f"{pair:>11} all steps, modelled: {total['before'] / 1e3:.2f} s before, "
              f"{total['now'] / 1e3:.2f} s now, {unpadded / 1e3:.2f} s unpadded")
    for row in compiles:
        print(f"{row['limits']:>11} warm-up {row['buckets']:6} {row['forwards']:3d} forwards + "
              f"{SAMPLER_VARIANTS} samplers x {row['sampler_row_counts']:2d} row counts = "
              f"{row['programs']:3d} programs")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "padding": results, "warm_up": compiles}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
