"""Benchmark building blocks, no model: metric formulas on hand-made timelines, the arrival
process, the workloads, the roofline, the KV waste / pool utilisation definition
(jaxllm.engine.kv_usage), output-token counting and the peak-memory sampler."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from jaxllm.benchmarks.datasets import (
    SHAREGPT_MAX_LEN,
    SHAREGPT_MIN_LEN,
    sample_requests,
    solve_mu,
    truncated_lognormal_mean,
)
from jaxllm.benchmarks.device_memory import PeakSampler
from jaxllm.benchmarks.hf_backend import count_generated, hf_kv_usage
from jaxllm.benchmarks.jax_backends import produced_tokens, static_batches, static_kv_usage
from jaxllm.benchmarks.metrics import (
    RequestTrace,
    TokenCountError,
    check_output_tokens,
    parse_prometheus,
    stats,
    summarize,
    throughput_over_time,
    tpot,
)
from jaxllm.benchmarks.serve_client import request_intervals

from jaxllm.engine.kv_usage import KVUsage, contiguous_batch, engine_usage, paged_step


def trace(start, chunk_times, tokens=None, prompt_len=10):
    """A successful request whose chunks arrive at absolute ``chunk_times``."""
    t = RequestTrace(prompt_len=prompt_len, start=start, success=True,
                     output_tokens=tokens or len(chunk_times))
    t.ttft = chunk_times[0] - start
    t.itl = list(np.diff(chunk_times))
    t.latency = chunk_times[-1] - start
    return t


def test_ttft_itl_tpot_e2el_on_a_hand_made_timeline():
    a = trace(0.0, [0.1, 0.15, 0.25])  # TTFT 100 ms, ITL 50/100, E2EL 250, TPOT 150/2
    b = trace(1.0, [1.3, 1.4], prompt_len=20)  # TTFT 300, ITL 100, E2EL 400, TPOT 100
    c = trace(2.0, [2.2])  # one token: no ITL, no TPOT
    failed = RequestTrace(prompt_len=99, start=0.5, error="HTTP 500")
    assert tpot(a) == pytest.approx(0.075) and tpot(c) is None
    r = summarize([a, b, c, failed], duration=4.0)
    assert (r["completed"], r["failed"]) == (3, 1)
    assert r["total_input_tokens"] == 40 and r["total_output_tokens"] == 6
    assert r["request_throughput"] == pytest.approx(0.75)
    assert r["output_throughput"] == pytest.approx(1.5)
    assert r["total_token_throughput"] == pytest.approx(46 / 4)
    assert r["mean_ttft_ms"] == pytest.approx(200.0)
    assert r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["mean_tpot_ms"] == pytest.approx(87.5)
    assert r["mean_itl_ms"] == pytest.approx(250 / 3)  # gaps pooled over requests
    assert r["median_itl_ms"] == pytest.approx(100.0)
    assert r["mean_e2el_ms"] == pytest.approx(1000 * (0.25 + 0.4 + 0.2) / 3)
    # numpy linear-interpolated percentiles over [100, 200, 300] ms TTFT
    assert r["p90_ttft_ms"] == pytest.approx(280.0)
    assert r["p99_ttft_ms"] == pytest.approx(298.0)
    assert r["p50_e2el_ms"] == pytest.approx(250.0)


def test_percentiles_follow_numpy_linear_interpolation():
    s = stats(list(range(1, 101)), (50, 90, 99, 99.9))
    assert s["p50"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01) and s["p99.9"] == pytest.approx(99.901)
    assert stats([], (99,)) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_throughput_over_time_bins_chunk_arrivals():
    traces = [trace(0.0, [0.1, 0.2, 1.5]), trace(0.0, [2.5])]
    seconds, rate = throughput_over_time(traces, origin=0.0)
    assert seconds.tolist() == [0.0, 1.0, 2.0] and rate.tolist() == [2.0, 1.0, 1.0]


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 1.0, 2.0, 8.0])
def test_gamma_arrivals_have_the_asked_mean_and_cv(burstiness):
    rate = 10.0
    gaps = request_intervals(40_000, rate, burstiness, seed=1)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Gamma(k, theta): CV = 1/sqrt(k); burstiness 1 is Poisson (exponential gaps, CV 1).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.04)
    assert (request_intervals(10, rate, burstiness, seed=3)
            == request_intervals(10, rate, burstiness, seed=3)).all()


def test_infinite_rate_sends_everything_at_once_and_bad_values_fail():
    assert request_intervals(5, float("inf")).tolist() == [0.0] * 5
    with pytest.raises(ValueError, match="burstiness"):
        request_intervals(5, 1.0, 0.0)
    with pytest.raises(ValueError, match="request_rate"):
        request_intervals(5, 0.0)


def test_sharegpt_like_matches_sharegpt_means_with_a_long_tail():
    for mean, sigma in ((202.0, 1.0), (179.0, 0.8)):
        mu = solve_mu(mean, sigma)
        assert truncated_lognormal_mean(mu, sigma, SHAREGPT_MIN_LEN,
                                        SHAREGPT_MAX_LEN) == pytest.approx(mean)
    reqs = sample_requests("sharegpt-like", 20_000, 32000, seed=0)
    prompt = np.array([r.prompt_len for r in reqs])
    output = np.array([r.output_len for r in reqs])
    assert prompt.mean() == pytest.approx(202, rel=0.03)
    assert output.mean() == pytest.approx(179, rel=0.03)
    assert np.median(prompt) < prompt.mean() and np.median(output) < output.mean()
    assert prompt.max() > 800 and prompt.min() >= 4 and output.max() <= 1024
    assert all(100 <= t < 32000 for r in reqs[:50] for t in r.prompt_ids)


def test_workloads_are_deterministic_and_respect_their_bounds():
    a = sample_requests("random", 50, 1000, seed=7, input_len=100, output_len=20,
                        range_ratio=0.5)
    assert a == sample_requests("random", 50, 1000, seed=7, input_len=100, output_len=20,
                                range_ratio=0.5)
    assert a != sample_requests("random", 50, 1000, seed=8, input_len=100, output_len=20,
                                range_ratio=0.5)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in a)
    fixed = sample_requests("random", 5, 1000, input_len=512, output_len=128)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(512, 128)}
    short = sample_requests("sharegpt-like", 500, 1000, max_model_len=256)
    assert max(r.prompt_len + r.output_len for r in short) <= 256
    with pytest.raises(ValueError, match="max_model_len"):
        sample_requests("random", 5, 1000, input_len=512, output_len=128, max_model_len=600)


def test_static_batching_kv_waste_is_counted_from_the_contiguous_layout():
    from jaxllm.benchmarks.datasets import Request

    reqs = [Request((1,) * 100, 10), Request((1,) * 28, 13), Request((1,) * 130, 3)]
    batches = list(static_batches(reqs, batch_size=2))
    # One compiled shape: every batch padded to the longest prompt (130 -> 256 slots); each
    # batch decodes its own longest output; the cache holds 16 output slots (13 rounded up).
    assert [(len(c), w, n) for c, w, n in batches] == [(2, 256, 13), (1, 256, 3)]
    reserved = 2 * (256 + 16) * 13 + 2 * (256 + 16) * 3
    used = (sum(100 + min(s, 10) for s in range(1, 14)) + sum(28 + s for s in range(1, 14))
            + sum(130 + s for s in range(1, 4)))
    usage = static_kv_usage(batches, 2)
    assert (usage.reserved, usage.used, usage.steps) == (reserved, used, 16)
    assert usage.waste == pytest.approx(1 - used / reserved) and usage.utilisation == 1.0


def test_paged_kv_waste_is_block_tables_against_tokens():
    # block_size 4: a 6-token sequence holding 2 blocks [t t t t][t t . .], a 3-token one holding
    # 2 (a block allocated ahead for its next tokens), in a pool of 10 usable blocks.
    step = paged_step([2, 2], [6, 3], block_size=4, usable_blocks=10)
    assert (step.reserved, step.used, step.capacity) == (16, 9, 40)
    assert step.waste == pytest.approx(7 / 16) and step.utilisation == pytest.approx(0.4)
    # Over a run: sums of slots, so a step with more reserved weighs more (time-averaged).
    run = step + paged_step([1], [4], block_size=4, usable_blocks=10)
    assert run.waste == pytest.approx(1 - 13 / 20) and run.utilisation == pytest.approx(20 / 80)
    assert run.steps == 2 and (run - step) == paged_step([1], [4], 4, 10)
    assert KVUsage().waste is None and KVUsage().as_dict()["kv_pool_utilisation"] is None
    with pytest.raises(ValueError, match="used"):
        KVUsage().add(reserved=4, used=5, capacity=8)


def test_engine_counters_read_through_the_same_definition():
    class Stats:  # EngineStats' fields
        kv_slots_reserved, kv_slots_used, kv_slots_capacity, num_steps = 64, 48, 640, 4

    usage = engine_usage(Stats())
    assert usage.as_dict() == {"kv_waste": 0.25, "kv_pool_utilisation": 0.1,
                               "kv_slots_reserved": 64, "kv_slots_used": 48,
                               "kv_slots_capacity": 640, "kv_steps": 4}


def test_contiguous_kv_waste_static_and_dynamic_caches():
    # Two real rows (prompts 3 and 1, outputs 2 and 4) in a 3-row batch padded to width 3, run
    # 4 decode steps. After step s a row holds prompt + min(s, output) real tokens.
    used = sum(3 + min(s, 2) + 1 + min(s, 4) for s in range(1, 5))
    static = contiguous_batch([3, 1], [2, 4], 4, rows=3, width=3, cache_len=8)
    assert (static.reserved, static.used, static.capacity) == (3 * 8 * 4, used, 3 * 8 * 4)
    # HF's dynamic cache holds width + s slots a row after step s.
    dynamic = contiguous_batch([3, 1], [2, 4], 4, rows=3, width=3, cache_len=None)
    assert dynamic.reserved == 3 * sum(3 + s for s in range(1, 5)) and dynamic.used == used
    assert static.utilisation == dynamic.utilisation == 1.0  # everything allocated is reserved
    assert dynamic.waste == pytest.approx(1 - used / dynamic.reserved)
    for steps in range(1, 9):  # the closed form of sum(min(s, o)) against the loop
        for out in range(0, 10):
            assert contiguous_batch([0], [out], steps, rows=1, width=0, cache_len=99).used \
                == sum(min(s, out) for s in range(1, steps + 1))
    # The hf child's layout goes through the same function.
    assert hf_kv_usage([[3, 3, 4, 8, [3, 1], [2, 4]], [3, 3, 4, None, [3, 1], [2, 4]]]) \
        == (static + dynamic).as_dict()
    assert hf_kv_usage(None)["kv_waste"] is None and "kv_note" in hf_kv_usage(None)


def test_output_tokens_are_counted_from_what_came_back():
    # hf: up to and including the first EOS (2), then padding; capped at the requested length.
    ids = [[5, 6, 7, 8], [5, 2, 0, 0], [2, 9, 9, 9], [5, 6, 7, 8]]
    assert count_generated(ids, [4, 4, 4, 2], eos_ids={2}) == [4, 2, 1, 2]
    assert count_generated(ids, [4, 4, 4, 4], eos_ids=set()) == [4, 4, 4, 4]
    # jax-static: generate()'s num_tokens per row, each real row up to its own length; the
    # padding rows past the chunk produce nothing useful.
    from jaxllm.benchmarks.datasets import Request

    chunk = [Request((1,), 3), Request((1,), 5)]
    assert produced_tokens(np.array([5, 4, 5, 5]), chunk) == 3 + 4
    assert check_output_tokens("x", 7, 7) == 7
    with pytest.raises(TokenCountError, match="x produced 7 output tokens but the workload "
                                              "asked for 8"):
        check_output_tokens("x", 7, 8)


def test_peak_memory_is_the_largest_sample_and_n_a_without_statistics():
    values = iter([10, 30, 20] + [5] * 10_000)
    with PeakSampler(lambda: next(values), interval_s=0.001) as s:
        import time

        time.sleep(0.05)
    assert s.peak == 30 and s.samples >= 3
    assert "largest of" in s.result("x")["peak_memory_kind"]
    with PeakSampler(lambda: None) as none:
        pass
    r = none.result("jax memory_stats bytes_in_use")
    assert r["peak_memory_bytes"] is None and r["peak_memory_kind"].startswith("n/a")


def test_roofline_reproduces_the_reference_llama3_8b_table():
    # performance.md section 6: W = 16.06 GB, 128 KiB KV per token, 4.3 TB/s, context 1024.
    from jaxllm.benchmarks.latency import kv_bytes_per_token, roofline_s

    from jaxllm.presets import PRESETS

    cfg = PRESETS["llama-3-8b"]
    assert kv_bytes_per_token(cfg, 2) == 131072
    for batch, ms in ((1, 3.766), (32, 4.734), (256, 11.73)):
        assert 1e3 * roofline_s(16.06e9, cfg, 2, batch, 1024, 4300) == pytest.approx(
            ms, rel=2e-3)
    # With a compute peak, the bound is the larger of memory and compute time.
    assert roofline_s(16.06e9, cfg, 2, 256, 1024, 4300, 7.5e9, 1e-3) > 1.0


def test_parse_prometheus_sums_label_sets():
    text = ('# HELP jaxllm:kv_cache_usage_perc x\n# TYPE jaxllm:kv_cache_usage_perc gauge\n'
            'jaxllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            'jaxllm:num_preemptions_total{model_name="m"} 3.0\n'
            'jaxllm:request_success_total{finished_reason="stop",model_name="m"} 2.0\n'
            'jaxllm:request_success_total{finished_reason="length",model_name="m"} 5.0\n')
    m = parse_prometheus(text)
    assert m["jaxllm:kv_cache_usage_perc"] == 0.25
    assert m["jaxllm:num_preemptions_total"] == 3.0
    assert m["jaxllm:request_success_total"] == 7.0


def test_jaxllm_cli_does_not_import_benchmarks():
    code = ("import sys, jaxllm.cli; jaxllm.cli.build_parser(); "
            "assert not any(m.startswith('benchmarks') for m in sys.modules)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
