"""Prefill half of ``benchmarks/kernels.py``: the PrefillConfig sweep, one row of timings per
(chunk, cached tokens) point, the pick of the best config and the prefill table.

One sequence: a chunk of new tokens over ``cached`` tokens already in the pool; TFLOP/s count
4 * Hq * D per valid query-key pair.

The plan, the block size and the timing helpers come in as arguments, not imports: kernels.py
usually runs as ``__main__``, so importing it from here would load a second copy of it holding
the default plan (and make an import cycle).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxllm.pallas_kernels.paged_attention import (
    PrefillConfig,
    paged_attention_prefill,
    paged_attention_reference,
)
from jaxllm.pallas_kernels.paged_attention.prefill_hopper import paged_attention_prefill_hopper
from jaxllm.pallas_kernels.paged_attention.prefill_hopper_config import HopperPrefillConfig
from jaxllm.pallas_kernels.paged_attention.shapes import HEAD_SHAPES


def _prefill_name(c: PrefillConfig) -> str:
    return (f"q{c.block_q_rows}_kv{c.block_kv}_w{c.num_warps}_s{c.num_stages}"
            + ("_heavy" if c.heavy_first else ""))


# The Hopper kernel's default first ("hopper": the table's column; 3 K + 2 V slots of 128
# keys, prefetch_q), then a variant that fits its shared memory at head_dim 128, every field
# that differs from the kernel's own default spelled out (4 x 64-key slots without
# prefetch_q, and 2 slots of 128 with it, were timed on 2026-12-03 and trail these; 4 x 64
# with prefetch_q trailed at 0 and 8k cached on 2026-12-04).
HOPPER_CONFIGS = {
    "hopper": HopperPrefillConfig(),
    "hopper_s3_one_q": HopperPrefillConfig(max_concurrent_steps=3, v_concurrent_steps=None,
                                           prefetch_q=False),
}
# Every field spelled out: a name stays true when the defaults change.
PREFILL_SWEEP = {_prefill_name(c): c for c in [
    PrefillConfig(block_q_rows=q, block_kv=kv, num_warps=w, num_stages=s, heavy_first=h)
    for q, kv, w, s, h in [
        (128, 64, 8, 3, False), (128, 64, 4, 3, False), (64, 64, 4, 3, False),
        (128, 128, 8, 2, False), (128, 128, 8, 2, True), (128, 32, 4, 4, False),
        (256, 64, 8, 3, False), (128, 128, 8, 3, False), (128, 128, 4, 2, False),
        (256, 128, 8, 2, False), (64, 128, 4, 3, False), (128, 128, 8, 4, False),
        (128, 128, 8, 3, True)]]}


def prefill_problem(chunk: int, cached: int, heads: str, *, block: int,
                    pseudo_random: Callable) -> dict:
    """One sequence's ``chunk`` new tokens over ``cached`` ones, its pages shuffled in a
    one-layer pool: the kernels' operands after q (k, v, tables, seq_lens, starts, positions)
    and the FLOPs of its valid query-key pairs."""
    h = HEAD_SHAPES[heads]
    total = chunk + cached
    pages = -(-total // block)
    shape = (1, pages + 1, block, h.num_kv_heads, h.head_dim)
    pairs = sum(cached + i + 1 for i in range(chunk))
    return {"k": pseudo_random(shape, 0.1), "v": pseudo_random(shape, 0.2),
            "tables": jnp.asarray(1 + np.random.default_rng(0).permutation(pages)[None],
                                  jnp.int32),
            "seq_lens": jnp.array([total], jnp.int32),
            "starts": jnp.array([0, chunk], jnp.int32),
            "positions": jnp.arange(cached, total, dtype=jnp.int32),
            "flops": 4 * h.num_q_heads * h.head_dim * pairs}


def prefill_call(fn: Callable, p: dict, scale: float) -> Callable:
    """``call(i, q_all, k, v)``: ``fn`` on the i-th query of ``q_all`` over
    :func:`prefill_problem` ``p``'s pool. ``fn`` is jitted on its own, so that a program of
    many calls traces and lowers it once (32 lowerings of the Mosaic kernel took k1 past its
    time limit)."""
    one = jax.jit(functools.partial(fn, scale=scale))
    return lambda i, q, k, v: one(q[i], k, v, 0, p["tables"], p["seq_lens"], p["starts"],
                                  p["positions"])


def bench_prefill(chunk: int, cached: int, impls: dict, *, plan, block: int,
                  pseudo_random: Callable, time_per_call: Callable) -> dict:
    """One row: each of ``impls`` on a ``chunk``-token prefill over ``cached`` tokens, with the
    plan's first head shape; ``pseudo_random`` and ``time_per_call`` are kernels.py's."""
    h = HEAD_SHAPES[plan.heads[0]]
    p = prefill_problem(chunk, cached, plan.heads[0], block=block, pseudo_random=pseudo_random)
    k, v, flops = p["k"], p["v"], p["flops"]
    result = {"chunk": chunk, "cached": cached, "GFLOP": flops / 1e9}
    for name, fn in impls.items():
        # One reference call a program: XLA merges the dots of calls that share K and V. The
        # kernels: 32 calls a program, as an engine step's 32 layers (one dispatch, the block
        # plan computed once); with 8, the program's ~0.5 ms of dispatch and plan was a third
        # of a 2k chunk's call on the H200 (benchmarks/prefill_anatomy.py, 2026-12-04).
        num_calls = 1 if name == "reference" else min(plan.max_calls, 32)
        q_all = pseudo_random((num_calls, chunk, h.num_q_heads, h.head_dim), 4.5)
        call = prefill_call(fn, p, h.head_dim ** -0.5)
        try:
            sec = time_per_call(call, num_calls, (q_all, k, v))
            result[name] = {"us": sec * 1e6, "tokens_per_s": chunk / sec,
                            "TFLOPs": flops / sec / 1e12}
        except Exception as e:  # noqa: BLE001
            result[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
        print(f"  prefill chunk {chunk} cached {cached} {name}: {result[name]}", flush=True)
    return result


def bench_prefill_points(plan, rows: list[dict], save: Callable[[], None], *, deadline: float,
                         sweep: bool, with_reference: bool, block: int,
                         pseudo_random: Callable, time_per_call: Callable,
                         with_hopper: bool = False) -> str | None:
    """A row per ``plan.prefill_points``, appended to ``rows`` and saved one by one. With
    ``sweep``, the points of the first chunk size run every config of PREFILL_SWEEP, and the rest
    only the default and the best of those; past ``deadline`` the sweep stops (and the reference,
    a minute later). ``with_hopper`` adds the Mosaic GPU kernel (prefill_hopper) in each of
    HOPPER_CONFIGS, last in each row. Returns the best config's name ("" with no sweep; None
    when the sweep ran but timed nothing)."""
    default = {"pallas": PrefillConfig()}  # bf16 pages: what the engine runs
    best = None if sweep else ""
    first_chunk = plan.prefill_points[0][0] if plan.prefill_points else 0
    for chunk, cached in plan.prefill_points:
        if best is None and (chunk != first_chunk or time.time() > deadline):
            best = pick_best_prefill([r for r in rows if r["chunk"] == first_chunk])
        configs = ({f"pallas_{n}": c for n, c in PREFILL_SWEEP.items()} if best is None
                   else default | ({f"pallas_{best}": PREFILL_SWEEP[best]} if best else {}))
        impls = {n: (lambda *a, c=c, **kw: paged_attention_prefill(
            *a, config=c, interpret=plan.interpret, **kw)) for n, c in configs.items()}
        if with_reference and time.time() < deadline + 60:
            impls["reference"] = paged_attention_reference
        if with_hopper:
            impls |= {n: (lambda *a, c=c, **kw: paged_attention_prefill_hopper(*a, config=c, **kw))
                      for n, c in HOPPER_CONFIGS.items()}
        rows.append(bench_prefill(chunk, cached, impls, plan=plan, block=block,
                                  pseudo_random=pseudo_random, time_per_call=time_per_call))
        save()
    return best


def pick_best_prefill(rows: list[dict]) -> str | None:
    scores: dict[str, list[float]] = {}
    for r in rows:
        for name, v in r.items():
            if name.startswith("pallas_") and isinstance(v, dict):
                scores.setdefault(name[len("pallas_"):], []).append(v["TFLOPs"])
    if not scores:
        return None
    return max(scores, key=lambda n: statistics.mean(scores[n]))


def _tflops(r) -> str:
    return f"{r['TFLOPs']:.2f}" if isinstance(r, dict) else "-"


def print_prefill_table(rows: list[dict]) -> None:
    print("prefill: chunk cached | best pallas config TFLOP/s, tokens/s | default | reference"
          " | hopper | best hopper config")
    for r in rows:
        ours = {k: v for k, v in r.items() if isinstance(v, dict) and k.startswith("pallas")}
        best = max(ours, key=lambda k: ours[k]["TFLOPs"]) if ours else None
        ref = r.get("reference")
        print(f"{r['chunk']:>5} {r['cached']:>5} | "
              + (f"{best} {ours[best]['TFLOPs']:.0f}, {ours[best]['tokens_per_s']:.3g}"
                 if best else "-")
              + f" | {_tflops(r.get('pallas', r.get('pallas_q128_kv128_w8_s2')))}"
              + f" | {_tflops(ref)} | {_tflops(r.get('hopper'))} | {_best_hopper(r)}")


def _best_hopper(r) -> str:
    timed = {n: r[n]["TFLOPs"] for n in HOPPER_CONFIGS if isinstance(r.get(n), dict)}
    return f"{max(timed, key=timed.get)} {max(timed.values()):.0f}" if timed else "-"
