"""The step's scatters on the device: this step's K/V rows written into a layer of the pool
(``jaxllm.kv_pool.write_kv``) and the decodes' rows written into the attention output
(``place_rows`` of ``paged_attention_mixed``), as the engine writes them (indices unique,
padding aimed at distinct rows past the end) against the form before (padding all aimed at
one row past the end, indices not declared unique), Llama-3-8B's KV heads.

The 2026-12-04 trace of the offline run's 8,192-token steps had ~150 us a layer of scatter
fusions for ~40 MB of rows. Each variant runs ``--calls`` times back to back on a donated
pool; the table gives microseconds a call and the rows' bytes a second.

    PYTHONPATH=. python -m jaxllm.benchmarks.kv_write --output-json out.json
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def _old_write_kv(pool, slots, k, v):
    """write_kv before 0a789bd: every padded token aimed at block ``num_blocks``."""
    num_blocks, block_size = pool.k.shape[1], pool.k.shape[2]
    blocks = jnp.where(slots < 0, num_blocks, slots // block_size)
    offsets = slots % block_size
    return type(pool)(k=pool.k.at[0, blocks, offsets].set(k, mode="drop"),
                      v=pool.v.at[0, blocks, offsets].set(v, mode="drop"))


def _old_rows(rest, rows, decoded):
    num_tokens = rest.shape[0]
    return rest.at[jnp.where(rows >= 0, rows, num_tokens)].set(decoded, mode="drop")


def _time(fn, state, args, calls: int) -> float:
    state = jax.block_until_ready(fn(state, *args))  # compiled, and the first run
    start = time.perf_counter()
    for _ in range(calls):
        state = fn(state, *args)
    jax.block_until_ready(state)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=8000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tokens", default="8192:7900,1024:1024",
                        help="TOKENS:REAL,...: step tokens and how many of them are real")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    from jaxllm.benchmarks.provenance import source_commit, write_json
    from jaxllm.pallas_kernels.paged_attention.mixed import place_rows

    from jaxllm.kv_pool import KVPool, write_kv

    kv_heads, head_dim, q_heads, dtype = 8, 128, 32, jnp.bfloat16
    rng = np.random.default_rng(0)
    shape = (1, args.num_blocks, args.block_size, kv_heads, head_dim)
    new_pool = lambda: KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    new_write = jax.jit(lambda p, s, k, v: write_kv(p, jnp.int32(0), s, k, v), donate_argnums=0)
    old_write = jax.jit(_old_write_kv, donate_argnums=0)
    rows = []
    for spec in args.tokens.split(","):
        num_tokens, real = (int(x) for x in spec.split(":"))
        slots = rng.permutation(args.num_blocks * args.block_size)[:num_tokens].astype(np.int32)
        slots[real:] = -1
        k = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, head_dim)), dtype)
        row_bytes = 2 * real * kv_heads * head_dim * 2  # K and V rows written
        got, want = (fn(new_pool(), jnp.asarray(slots), k, k) for fn in (new_write, old_write))
        if not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), got, want))):
            raise SystemExit(f"BAD: the two writes of {spec} differ")
        del got, want
        for name, fn in (("kv_write_unique", new_write), ("kv_write_before", old_write)):
            sec = _time(fn, new_pool(), (jnp.asarray(slots), k, k), args.calls)
            rows.append({"what": name, "tokens": num_tokens, "real": real, "us": sec * 1e6,
                         "GBps": row_bytes / sec / 1e9})
            print(rows[-1], flush=True)
    # The decodes' rows into a mixed step's attention output: 8,192 tokens, 1,024 sequences,
    # 1,000 of them with a token.
    new_rest = lambda: jnp.zeros((8192, q_heads, head_dim), dtype)
    dec_rows = np.sort(rng.permutation(8192)[:1024]).astype(np.int32)
    dec_rows[1000:] = -1
    decoded = jnp.asarray(rng.standard_normal((1024, q_heads, head_dim)), dtype)
    got, want = (jax.jit(fn)(new_rest(), jnp.asarray(dec_rows), decoded)
                 for fn in (place_rows, _old_rows))
    if not bool((got == want).all()):
        raise SystemExit("BAD: the two writes of the decodes' rows differ")
    del got, want
    for name, fn in (("decoded_rows_unique", place_rows), ("decoded_rows_before", _old_rows)):
        sec = _time(jax.jit(fn, donate_argnums=0), new_rest(), (jnp.asarray(dec_rows), decoded),
                    args.calls)
        rows.append({"what": name, "tokens": 8192, "real": 1000, "us": sec * 1e6,
                     "GBps": 1000 * q_heads * head_dim * 2 / sec / 1e9})
        print(rows[-1], flush=True)
    print(f"{'what':<22} {'tokens':>7} {'real':>6} {'us a call':>10} {'GB/s':>8}")
    for r in rows:
        print(f"{r['what']:<22} {r['tokens']:>7} {r['real']:>6} {r['us']:>10.1f} {r['GBps']:>8.1f}")
    write_json({"benchmark": "kv_write", "commit": source_commit(),
                "device": jax.devices()[0].device_kind, "args": vars(args), "rows": rows},
               args.output_json)


if __name__ == "__main__":
    main()
