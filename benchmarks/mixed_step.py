"""Attention of one engine-like mixed step: many decodes plus a few prompt chunks, through the
prefill kernel alone (every token) and through ``paged_attention_mixed`` (the decode kernel
for each sequence's last token, the prefill kernel for the rest). One GPU run::

    PYTHONPATH=. python benchmarks/mixed_step.py --out mixed_step.json

Default: Llama-3-8B heads (32/8, dim 128), 250 decodes over contexts spread in 1..2047 plus
chunks of 300 new tokens (no cache) and 64 new over 512 cached, blocks of 16, bf16; the step's
tokens padded to the engine's 768-token bucket. Timing as ``benchmarks/kernels.py``: one
program holds ``--layers`` independent calls, each on its own layer of the pool (cold in L2);
median after a warm-up, minus dispatch, per call. ``step_ms`` = per call x
``--model-layers`` (32), the attention share of one forward step.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jaxllm.benchmarks.kernels import pseudo_random, time_per_call
from jaxllm.pallas_kernels.paged_attention import (
    paged_attention_mixed,
    paged_attention_prefill,
    paged_attention_reference,
)
from jaxllm.pallas_kernels.paged_attention.shapes import HEAD_SHAPES


def build_step(heads: str, decode_contexts, chunks, padded_tokens: int, block_size: int,
               num_layers: int, dtype):
    """(args without q, q[L, T, Hq, D], real tokens): a pool with num_layers layers."""
    h = HEAD_SHAPES[heads]
    seqs = [(c - 1, 1) for c in decode_contexts] + list(chunks)  # (cached, new)
    pages = [-(-(c + n) // block_size) for c, n in seqs]
    width = max(pages)
    tables = np.zeros((len(seqs), width), np.int32)
    next_block = 1
    for s, n in enumerate(pages):
        tables[s, :n] = range(next_block, next_block + n)
        next_block += n
    starts = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    real = int(starts[-1])
    if padded_tokens < real:
        raise ValueError(f"--padded-tokens {padded_tokens} < the step's {real} tokens")
    positions = np.concatenate([np.arange(c, c + n) for c, n in seqs] +
                               [np.zeros(padded_tokens - real, np.int64)]).astype(np.int32)
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    shape = (num_layers, next_block, block_size, h.num_kv_heads, h.head_dim)
    k, v = pseudo_random(shape, 0.1, dtype), pseudo_random(shape, 0.2, dtype)
    q = pseudo_random((num_layers, padded_tokens, h.num_q_heads, h.head_dim), 4.5, dtype)
    args = (k, v, jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(starts),
            jnp.asarray(positions))
    return args, q, real, h.head_dim ** -0.5


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", default="llama3_8b", choices=sorted(HEAD_SHAPES))
    parser.add_argument("--decodes", type=int, default=250)
    parser.add_argument("--max-context", type=int, default=2047)
    parser.add_argument("--chunks", default="300@0,64@512",
                        help="prompt chunks as NEW@CACHED, comma-separated")
    parser.add_argument("--padded-tokens", type=int, default=768)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=16, help="calls (pool layers) timed")
    parser.add_argument("--model-layers", type=int, default=32)
    parser.add_argument("--reference", action="store_true", help="also time the XLA reference")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in the Pallas interpreter (checks this script on CPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    interpret = args.smoke or jax.default_backend() != "gpu"
    chunks = []  # (cached, new) like the decodes
    for c in filter(None, args.chunks.split(",")):
        new, _, cached = c.partition("@")
        chunks.append((int(cached or 0), int(new)))
    rng = np.random.default_rng(0)
    contexts = rng.integers(1, args.max_context + 1, size=args.decodes).tolist()
    step, q_all, real, scale = build_step(args.heads, contexts, chunks, args.padded_tokens,
                                          args.block_size, args.layers, jnp.bfloat16)
    impls = {"prefill_kernel": paged_attention_prefill, "mixed": paged_attention_mixed}
    if args.reference:
        impls["reference"] = paged_attention_reference
    result = {"device": jax.devices()[0].device_kind, "heads": args.heads,
              "decodes": args.decodes, "chunks_cached_new": chunks, "real_tokens": real,
              "padded_tokens": args.padded_tokens, "layers": args.layers, "ms_per_layer": {},
              "step_ms": {}}
    outputs = {}
    for name, fn in impls.items():
        kw = {} if name == "reference" else {"interpret": interpret}
        call = lambda i, q, k, v, t, sl, st, pos, fn=fn, kw=kw: fn(
            q[i], k, v, i, t, sl, st, pos, scale=scale, **kw)
        seconds = time_per_call(call, args.layers, (q_all, *step))
        result["ms_per_layer"][name] = 1e3 * seconds
        result["step_ms"][name] = 1e3 * seconds * args.model_layers
        outputs[name] = np.asarray(call(0, q_all, *step)[:real], np.float32)
        print(f"{name}: {1e3 * seconds:.4f} ms a layer, {result['step_ms'][name]:.3f} ms for "
              f"{args.model_layers}", flush=True)
    # Both kernels must agree on every real token (they are tested against the reference).
    err = float(np.abs(outputs["mixed"] - outputs["prefill_kernel"]).max())
    result["max_abs_diff_mixed_vs_prefill"] = err
    speedup = result["ms_per_layer"]["prefill_kernel"] / result["ms_per_layer"]["mixed"]
    result["mixed_speedup"] = speedup
    print(f"mixed / prefill-kernel speed-up {speedup:.2f}x; max |diff| {err:.3g}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if err < 0.1 else 1


if __name__ == "__main__":
    sys.exit(main())
