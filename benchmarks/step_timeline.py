"""Every step of one offline run: its shape, when its tokens reached the host, and its floor.

Runs ``bench throughput``'s jaxllm workload once, timed as ``bench throughput`` times it (the
clock starts before the requests are added and stops when the last one finishes; warm-up and
compilation happen before), with no profiler. For every step it records:

- the shape: real and padded tokens (T) and rows (S), decode-only or mixed, the sequences and
  sampled rows, and the KV tokens its attention reads (the sum of the sequences' context
  lengths after the step) and the query-key pairs it scores;
- the host phases the engine measures (``EngineStats``): schedule and prepare of the call that
  launched it, update and device wait of its ``_record``;
- ``done``: when its sampled tokens were on the host. The engine is wrapped on the instance,
  nothing in ``jaxllm/engine/`` changes: ``_launch`` (a timestamp when it returns) and
  ``_record``, whose ``pending.wait()`` (the ``device_get`` of the samples) is timed. A
  timestamp after ``engine.step()`` returns would add the recording of the tokens (update)
  that follows the wait.

What ``done`` measures under async scheduling (the default): one ``engine.step()`` call
schedules and launches step k+1, then builds outputs, then waits for step k. The device holds
k+1 behind k, so it runs on without a gap while the host waits, and ``done_k`` is the end of k
on the device plus the samples' copy, whenever the host had to wait (``wait`` above
``--wait-threshold-ms``). Then ``interval_k = done_k - done_(k-1)`` is step k's device time
(the copy latency cancels). A step whose wait was shorter was finished before the host asked:
its interval is host-bound (flagged ``host_bound``): an upper bound on its device time.
``device_ms`` = ``done_k - max(done_(k-1), launched_k)`` also drops the device idle before a
late launch (sync steps, the first step). Intervals sum to the timed wall less the tail after
the last step's tokens (the final outputs); step 0's interval holds adding the requests.

Floor of a step (a roofline; one device of ``--tensor-parallel-size``, pipeline stages not
modelled):

    floor = max(weight bytes / BW, 2 * (layer matmul params * T + head params * S) / PEAK)
          + max(KV tokens * KV bytes a token / BW, 4 * Hq * D * layers * pairs / PEAK)

Weight bytes are every parameter but an untied embedding table (a step gathers T of its
rows); the LM head runs on the S sampled rows. The padded floor uses the step's buckets (T, S);
the exact floor the real tokens and rows (what buckets of the exact size would give). BW and
PEAK default to H200 figures (``--bandwidth 4.8e12`` B/s, ``--peak-flops 700e12``), or
``measure``: the copy rate as ``bench latency`` measures it, a bf16 matmul's rate.

Prints a table by bins (decode-only steps by real rows, mixed steps by real tokens): steps,
share of the wall, mean interval and device ms, host-bound steps, mean real/padded rows and
tokens, KV tokens, mean floor, efficiency (floor / interval, summed over the bin), the time
lost against the floor and the part of the floor that padding adds; then the totals. Writes
the same with every step's record as JSON (``--output-json``, default step_timeline.json).

Issue 17's run on one H200 (Llama-3-8B shape, dummy bf16, no tokenizer needed offline; the
memory fraction as benchmarks/gpu_chain.sh sets it: 48000 KV blocks and the weights need
more than JAX's default 75%); nominal ceilings, or ``--bandwidth measure --peak-flops
measure`` (the JSON keeps every step's sizes: floors under other ceilings can be recomputed):

    PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python3 -m jaxllm.benchmarks.step_timeline \
        --model llama-3-8b --load-format dummy --dtype bfloat16 --no-progress \
        --dataset-name sharegpt-like --num-prompts 1000 --max-num-seqs 1024 \
        --max-num-batched-tokens 8192 --num-gpu-blocks-override 48000 --unroll-layers \
        --output-json step_timeline_8b.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import types

import numpy as np
from jaxllm.benchmarks.step_profile import add_gemv_overrides_argument

STEP_PHASES = ("schedule", "prepare", "update", "device_wait")


def _rate(text: str) -> float | str:
    if text == "measure":
        return text
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: want a positive number or 'measure'")
    return value


def _edges(text: str) -> tuple[int, ...]:
    edges = tuple(int(x) for x in text.split(","))
    if not edges or edges[0] < 1 or list(edges) != sorted(set(edges)):
        raise argparse.ArgumentTypeError(f"{text}: want increasing integers >= 1")
    return edges


def add_args(parser: argparse.ArgumentParser) -> None:
    from jaxllm.benchmarks.throughput import add_args as throughput_args

    throughput_args(parser)
    r = parser.add_argument_group("step timeline")
    add_gemv_overrides_argument(r)
    r.add_argument("--bandwidth", type=_rate, default=4.8e12,
                   help="HBM bytes/s of the floor, or 'measure' (a copy, as bench latency)")
    r.add_argument("--peak-flops", type=_rate, default=700e12,
                   help="matmul FLOP/s of the floor, or 'measure' (a bf16 matmul)")
    r.add_argument("--row-bins", type=_edges, default=(16, 64, 128, 256, 512, 1024),
                   help="upper edges of the decode-only bins, by real rows")
    r.add_argument("--token-bins", type=_edges, default=(512, 2048, 4096, 8192),
                   help="upper edges of the mixed-step bins, by real tokens")
    r.add_argument("--wait-threshold-ms", type=float, default=0.1,
                   help="a step whose host wait was shorter is flagged host-bound")


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A step's cost floor (module docstring); bytes and FLOPs are one device's share."""

    weight_bytes: float
    layer_params: int  # matmul weights a token passes through, every layer
    head_params: int  # the LM head's, a sampled row
    kv_bytes_per_token: int  # K and V, every layer
    attn_flops_per_pair: int  # QK and PV: 4 * Hq * D * layers
    bandwidth: float  # B/s
    peak_flops: float  # FLOP/s
    tensor_parallel_size: int = 1

    def floor_s(self, tokens: int, rows: int, kv_tokens: int, pairs: int) -> float:
        tp = self.tensor_parallel_size
        gemm = 2 * (self.layer_params * tokens + self.head_params * rows) / tp
        attn = max(kv_tokens * self.kv_bytes_per_token / tp / self.bandwidth,
                   pairs * self.attn_flops_per_pair / tp / self.peak_flops)
        return max(self.weight_bytes / self.bandwidth, gemm / self.peak_flops) + attn


def roofline(model, args, bandwidth: float, peak_flops: float) -> Roofline:
    import jax
    from jaxllm.benchmarks.latency import kv_bytes_per_token

    from jaxllm.kv_pool import kv_cache_dtype
    from jaxllm.layers.linear import one_layout

    cfg = model.config
    # a step reads one of a projection's two layouts (JAXLLM_INT4_HOPPER=both)
    leaves = jax.tree_util.tree_leaves_with_path(one_layout(model.params))
    first = min(leaves[0][1].sharding.device_set, key=str)
    from jaxllm.engine.device_memory import stored_bytes
    weight_bytes = sum(stored_bytes(s.data) for path, x in leaves for s in x.addressable_shards
                       if s.device == first and (cfg.tie_word_embeddings or "embed_tokens"
                                                 not in jax.tree_util.keystr(path)))
    h, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    itemsize = np.dtype(kv_cache_dtype(args.kv_cache_dtype, model.dtype)).itemsize
    return Roofline(
        weight_bytes=weight_bytes,
        layer_params=cfg.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * f),
        head_params=h * cfg.vocab_size, kv_bytes_per_token=kv_bytes_per_token(cfg, itemsize),
        attn_flops_per_pair=4 * q * cfg.num_hidden_layers, bandwidth=bandwidth,
        peak_flops=peak_flops, tensor_parallel_size=args.tensor_parallel_size)


def measure_ceilings(bandwidth, peak_flops) -> tuple[float, float, dict]:
    """The flags' figures, each 'measure' replaced by a measurement on this device."""
    import jax
    import jax.numpy as jnp
    from jaxllm.benchmarks.kernels import dispatch_time, run_timed
    from jaxllm.benchmarks.latency import measure_bandwidth_gbps

    on_gpu = jax.default_backend() != "cpu"
    how = {"bandwidth": "given", "peak_flops": "given"}
    if bandwidth == "measure":
        size = 4096 if on_gpu else 64
        bandwidth, how["bandwidth"] = 1e9 * measure_bandwidth_gbps(size), f"copy of {size} MiB"
    if peak_flops == "measure":
        m = 8192 if on_gpu else 256
        a = jnp.full((m, m), 0.01, jnp.bfloat16)
        loop = jax.jit(lambda a: jax.lax.fori_loop(0, 10, lambda _, c: (c @ a) * 0.5, a))
        seconds = max(run_timed(loop, (a,), reps=3) - dispatch_time(), 1e-9) / 10
        peak_flops, how["peak_flops"] = 2 * m**3 / seconds, f"bf16 {m}^3 matmul"
    return bandwidth, peak_flops, how


def _pairs(start: int, n: int, window: int | None) -> int:
    """Query-key pairs of tokens start .. start + n - 1 under causal attention (each sees its
    position + 1 keys, at most ``window``)."""
    w = window or start + n
    full = max(0, min(start + n, w) - start)  # positions whose row is not clipped
    return full * start + full * (full + 1) // 2 + (n - full) * w


class StepRecorder:
    """Wraps an engine's ``_launch`` and ``_record`` on the instance and keeps one record per
    step, in launch order (which is also the order their tokens are recorded)."""

    def __init__(self, engine, window: int | None):
        from jaxllm.benchmarks.step_profile import _step_info

        self.engine, self.records = engine, []
        self._open: dict[int, dict] = {}  # id(launched step) -> its record, until recorded
        self._launched_now: dict | None = None
        launch, record, stats = engine._launch, engine._record, engine.stats

        def timed_launch(out, prepared, prev):
            step = launch(out, prepared, prev)
            rec = _step_info(types.SimpleNamespace(_inflight=step))
            rec["launched"] = time.perf_counter()
            scheduled = out.scheduled
            rec.update(
                seqs=len(scheduled), sample_rows=len(out.sample_rows),
                kv_tokens=sum(min(s.start + s.num_new_tokens, window or 1 << 62)
                              for s in scheduled),
                pairs=sum(_pairs(s.start, s.num_new_tokens, window) for s in scheduled))
            self.records.append(rec)
            self._open[id(step)] = self._launched_now = rec
            return step

        def timed_record(step, following=None):
            rec, inner = self._open.pop(id(step)), step.pending.wait

            def wait():
                rec["wait_start"] = time.perf_counter()
                result = inner()
                rec["done"] = time.perf_counter()
                return result

            step.pending.wait = wait
            before = stats.update_seconds, stats.device_wait_seconds
            record(step, following)
            rec["update_ms"] = 1e3 * (stats.update_seconds - before[0])
            rec["device_wait_ms"] = 1e3 * (stats.device_wait_seconds - before[1])

        engine._launch, engine._record = timed_launch, timed_record

    def step(self):
        """``engine.step()``; its schedule and prepare time go to the step it launched."""
        stats, self._launched_now = self.engine.stats, None
        before = stats.schedule_seconds, stats.prepare_seconds
        outputs = self.engine.step()
        if self._launched_now is not None:
            self._launched_now["schedule_ms"] = 1e3 * (stats.schedule_seconds - before[0])
            self._launched_now["prepare_ms"] = 1e3 * (stats.prepare_seconds - before[1])
        return outputs


def derive(records: list[dict], start: float, floor: Roofline, wait_threshold_ms: float
           ) -> list[dict]:
    """Each record with its times relative to ``start`` (ms), interval, device time, the
    host-bound flag and its two floors (module docstring)."""
    steps, prev = [], start
    for i, r in enumerate(records):
        if "done" not in r:
            raise RuntimeError(f"step {i} was launched but its tokens were never recorded")
        wait_ms = 1e3 * (r["done"] - r["wait_start"])
        steps.append({
            "step": i, "decode": r["decode"], "real_tokens": r["real_tokens"],
            "bucket_tokens": r["bucket_tokens"], "real_rows": max(r["seqs"], r["sample_rows"]),
            "bucket_rows": r["rows"], "seqs": r["seqs"], "sample_rows": r["sample_rows"],
            "kv_tokens": r["kv_tokens"], "pairs": r["pairs"],
            "launched_ms": 1e3 * (r["launched"] - start), "done_ms": 1e3 * (r["done"] - start),
            "interval_ms": 1e3 * (r["done"] - prev),
            "device_ms": 1e3 * (r["done"] - max(prev, r["launched"])),
            "wait_ms": wait_ms, "host_bound": wait_ms < wait_threshold_ms,
            **{f"{p}_ms": r.get(f"{p}_ms", 0.0) for p in STEP_PHASES},
            "floor_ms": 1e3 * floor.floor_s(r["bucket_tokens"], r["rows"], r["kv_tokens"],
                                             r["pairs"]),
            "exact_floor_ms": 1e3 * floor.floor_s(r["real_tokens"], r["sample_rows"],
                                                  r["kv_tokens"], r["pairs"])})
        prev = r["done"]
    return steps


def _bin_name(step: dict, row_edges, token_edges) -> str:
    kind, value, edges = (("decode", step["real_rows"], row_edges) if step["decode"] else
                          ("mixed", step["real_tokens"], token_edges))
    lo = 1
    for edge in edges:
        if value <= edge:
            return f"{kind} {lo}-{edge}"
        lo = edge + 1
    return f"{kind} >{edges[-1]}"


def summarize(steps: list[dict], wall_s: float, row_edges, token_edges) -> tuple[list, dict]:
    """The bins (decode-only first, then mixed, by size) and the totals."""
    groups: dict[str, list[dict]] = {}
    for s in steps:
        groups.setdefault(_bin_name(s, row_edges, token_edges), []).append(s)

    def order(name: str):
        kind, size = name.split(" ")
        return kind != "decode", int(size.lstrip(">").split("-")[0]) + (">" in size)

    def agg(group: list[dict]) -> dict:
        total = lambda k: float(sum(s[k] for s in group))
        mean = lambda k: total(k) / len(group)
        return {"steps": len(group), "interval_s": total("interval_ms") / 1e3,
                "wall_share": total("interval_ms") / 1e3 / wall_s,
                "mean_ms": mean("interval_ms"), "mean_device_ms": mean("device_ms"),
                "host_bound_steps": sum(s["host_bound"] for s in group),
                "host_bound_s": sum(s["interval_ms"] for s in group if s["host_bound"]) / 1e3,
                **{f"mean_{k}": mean(k) for k in ("real_rows", "bucket_rows", "real_tokens",
                                                  "bucket_tokens", "kv_tokens")},
                **{f"mean_{p}_ms": mean(f"{p}_ms") for p in STEP_PHASES},
                "mean_floor_ms": mean("floor_ms"), "floor_s": total("floor_ms") / 1e3,
                "exact_floor_s": total("exact_floor_ms") / 1e3,
                "efficiency": total("floor_ms") / max(total("interval_ms"), 1e-12),
                "lost_s": (total("interval_ms") - total("floor_ms")) / 1e3,
                "padding_s": (total("floor_ms") - total("exact_floor_ms")) / 1e3}

    bins = [{"bin": name, **agg(groups[name])} for name in sorted(groups, key=order)]
    totals = {"wall_s": wall_s, **agg(steps),
              "tail_s": wall_s - sum(s["interval_ms"] for s in steps) / 1e3}
    return bins, totals


def _print(bins: list[dict], totals: dict, result: dict) -> None:
    f = result["floor_model"]
    print(f"floor: weights {f['weight_bytes'] / 1e9:.4g} GB = "
          f"{1e3 * f['weight_bytes'] / f['bandwidth']:.3g} ms at {f['bandwidth'] / 1e9:,.0f} GB/s "
          f"({result['ceilings']['bandwidth']}), peak {f['peak_flops'] / 1e12:.4g} TFLOP/s "
          f"({result['ceilings']['peak_flops']}), KV {f['kv_bytes_per_token'] / 1024:.1f} "
          f"KiB/token")
    head = (f"{'bin':17s} {'steps':>5s} {'wall%':>6s} {'ms':>8s} {'dev ms':>8s} {'host-b':>6s} "
            f"{'rows real/pad':>13s} {'tokens real/pad':>15s} {'KV tok':>8s} {'floor ms':>8s} "
            f"{'eff':>5s} {'lost s':>7s} {'pad s':>6s}")
    print(head)
    for b in [*bins, {"bin": "total", **totals}]:
        print(f"{b['bin']:17s} {b['steps']:5d} {100 * b['wall_share']:5.1f}% "
              f"{b['mean_ms']:8.3f} {b['mean_device_ms']:8.3f} {b['host_bound_steps']:6d} "
              f"{b['mean_real_rows']:6.0f}/{b['mean_bucket_rows']:<6.0f} "
              f"{b['mean_real_tokens']:7.0f}/{b['mean_bucket_tokens']:<7.0f} "
              f"{b['mean_kv_tokens']:8.0f} {b['mean_floor_ms']:8.3g} "
              f"{100 * b['efficiency']:4.0f}% {b['lost_s']:7.3f} {b['padding_s']:6.3f}")
    t, tokens = totals, result["output_tokens"]
    print(f"wall {t['wall_s']:.3f} s ({tokens / t['wall_s']:,.0f} output tok/s), steps "
          f"{t['interval_s']:.3f} s + tail {t['tail_s']:.3f} s; floor with these steps "
          f"{t['floor_s']:.3f} s ({tokens / t['floor_s']:,.0f} tok/s), with zero padding "
          f"{t['exact_floor_s']:.3f} s ({tokens / t['exact_floor_s']:,.0f} tok/s)")
    print("host ms a step: " + ", ".join(f"{p} {t[f'mean_{p}_ms']:.3f}" for p in STEP_PHASES))


def run(args: argparse.Namespace) -> dict:
    from jaxllm.benchmarks.host_step import GcTimer
    from jaxllm.benchmarks.jax_backends import add_workload, make_engine
    from jaxllm.benchmarks.provenance import source_commit
    from jaxllm.benchmarks.throughput import _requests, load_jax_model

    from jaxllm.engine import gc_watch

    if args.gemv_overrides:
        from jaxllm.benchmarks.step_profile import override_gemv

        args.compilation_cache_dir = override_gemv(args.gemv_overrides)
    model = load_jax_model(args)
    requests = _requests(args, model.config)
    bandwidth, peak, how = measure_ceilings(args.bandwidth, args.peak_flops)
    floor = roofline(model, args, bandwidth, peak)
    engine = make_engine(model, args)
    recorder = StepRecorder(engine, model.config.sliding_window)
    steps_before = engine.stats.num_steps

    gc_timer = GcTimer()  # a long collection is a step's stall the table cannot name
    gc_timer.on = True
    with gc_watch.frozen_heap():  # as bench throughput and LLM.generate
        start = time.perf_counter()  # as bench throughput: from adding the requests
        add_workload(engine, requests, args)
        produced = 0
        while engine.has_unfinished_requests():
            produced += sum(len(c.token_ids) for o in recorder.step() if o.finished
                            for c in o.outputs)
        wall = time.perf_counter() - start
    gc_timer.on = False

    steps = derive(recorder.records, start, floor, args.wait_threshold_ms)
    bins, totals = summarize(steps, wall, args.row_bins, args.token_bins)
    result = {"commit": source_commit(), "output_tokens": produced,
              "output_tokens_per_s": produced / wall,
              "engine_steps": engine.stats.num_steps - steps_before,
              "floor_model": dataclasses.asdict(floor), "ceilings": how,
              "args": {k: v for k, v in vars(args).items()
                       if isinstance(v, (int, float, str, bool, type(None), tuple))},
              "bins": bins, "totals": totals, "steps": steps,
              "gc": {"by_generation": gc_timer.by_generation, "seconds": gc_timer.seconds,
                     "longest_s": gc_timer.longest}}
    _print(bins, totals, result)
    print(f"garbage collections during the run: {gc_timer.collections}, "
          f"{1e3 * gc_timer.seconds:.0f} ms in all, longest {1e3 * gc_timer.longest:.0f} ms")
    path = args.output_json or "step_timeline.json"
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
