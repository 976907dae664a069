"""Where ``jaxllm.generate()`` spends a static batch's time: its prefill, and its decode step as
the output capacity (``max_new_tokens``, which sizes each row's contiguous cache) grows while
the rows' real contexts stay the same. ``bench throughput --backend jax-static`` runs one
``generate()`` per static batch; on the H200 its Llama-3-8B decode step at batch 256 took
~33 ms at capacity 128 and ~130 ms at 944 (benchmarks/RESULTS.md, fourth session), while the
engine's whole average step was 14.7 ms. One GPU run::

    PYTHONPATH=. python benchmarks/generate_step.py --model llama-3-8b --batch-size 256 \\
        --prompt-len 256 --capacities 128,1024 --out generate_step.json

For each capacity C one program is compiled (``max_new_tokens=C``, per-row lengths as an
argument) and run twice: every row generating ``--short`` tokens, then ``--short +
--decode-steps``. decode ms = the difference / ``--decode-steps`` (contexts prompt + short ..
prompt + short + steps, the same at every C); prefill ms = the short run minus its decode
steps. Temperature-1 sampling as jax-static (``--top-p`` below 1 adds the vocabulary sort). The
compiled program's temporaries (XLA's plan) are printed beside the contiguous cache size: a
temporary the size of the cache, or a step growing with C, means the cache is copied.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
from jaxllm.benchmarks.provenance import source_commit

import jaxllm
from jaxllm.engine.engine_config import resolve_unroll_layers
from jaxllm.kv_pool import kv_block_bytes


def time_program(call, *args) -> float:
    jax.block_until_ready(call(*args))  # first call: transfers and autotuning out of the way
    start = time.perf_counter()
    jax.block_until_ready(call(*args))
    return time.perf_counter() - start


def measure(model, batch_size: int, prompt_len: int, capacity: int, short: int, steps: int,
            top_p: float, block_size: int) -> dict:
    cfg = model.config
    ids = (jnp.arange(batch_size * prompt_len, dtype=jnp.int32).reshape(batch_size, prompt_len)
           % cfg.vocab_size)
    lens = jnp.full((batch_size,), prompt_len, jnp.int32)

    def run(params, ids, lens, new, key):
        return jaxllm.generate(params, ids, lens, key, config=cfg, max_new_tokens=capacity,
                               row_max_new_tokens=new, temperature=1.0, top_p=top_p,
                               block_size=block_size).tokens

    new_short = jnp.full((batch_size,), short, jnp.int32)
    call = jax.jit(run).lower(model.params, ids, lens, new_short, jax.random.key(0)).compile()
    plan = call.memory_analysis()
    temp = int(getattr(plan, "temp_size_in_bytes", 0) or 0)
    t_short = time_program(call, model.params, ids, lens, new_short, jax.random.key(1))
    t_long = time_program(call, model.params, ids, lens, new_short + steps, jax.random.key(2))
    decode_ms = 1e3 * (t_long - t_short) / steps
    blocks = batch_size * -(-(prompt_len + capacity) // block_size)
    return {"capacity": capacity, "decode_ms": decode_ms,
            "prefill_ms": 1e3 * t_short - decode_ms * (short - 1),
            "temp_bytes": temp,
            "contiguous_cache_bytes":
                blocks * kv_block_bytes(model.config, block_size, model.dtype)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--capacities", default="128,1024")
    p.add_argument("--short", type=int, default=4, help="tokens a row generates in the short run")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="per-layer params (default: on GPU, as jax-static)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    capacities = [int(c) for c in args.capacities.split(",")]
    if min(capacities) < args.short + args.decode_steps:
        p.error(f"every capacity must hold --short + --decode-steps = "
                f"{args.short + args.decode_steps} tokens")
    unrolled = resolve_unroll_layers(args.unroll_layers, jax.default_backend())
    model = jaxllm.load_model(args.model, dtype=args.dtype, load_format=args.load_format,
                              unroll_layers=unrolled)
    rows = []
    print(f"{model.name}, batch {args.batch_size}, prompt {args.prompt_len}, "
          f"{'unrolled' if unrolled else 'scanned'} layers, top_p {args.top_p}")
    print(f"{'capacity':>9} {'decode ms':>10} {'prefill ms':>11} {'temp GB':>8} {'cache GB':>9}")
    for capacity in capacities:
        r = measure(model, args.batch_size, args.prompt_len, capacity, args.short,
                    args.decode_steps, args.top_p, args.block_size)
        rows.append(r)
        print(f"{capacity:>9} {r['decode_ms']:>10.2f} {r['prefill_ms']:>11.1f} "
              f"{r['temp_bytes'] / 1e9:>8.2f} {r['contiguous_cache_bytes'] / 1e9:>9.2f}",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": source_commit(), "device": jax.devices()[0].device_kind,
                       "args": vars(args), "unrolled": unrolled, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
