"""``benchmarks/step_timeline.py`` end to end on CPU: a tiny dummy model, 20 prompts. Its
records must cover every engine step, its bins must add up to its totals, and no real size may
exceed its bucket. No timing is asserted (CPU times say nothing about the GPU's)."""

from __future__ import annotations

import json

import pytest
from jaxllm.benchmarks.datasets import sample_requests
from jaxllm.benchmarks.step_timeline import _pairs, main
from tiny_models import TINY


def test_step_timeline_covers_every_step_and_its_bins_add_up(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY, "architectures": ["LlamaForCausalLM"],
                                  "bos_token_id": 1, "eos_token_id": 2}))
    out = tmp_path / "timeline.json"
    assert main(["--model", str(config), "--load-format", "dummy", "--dtype", "float32",
                 "--no-progress", "--dataset-name", "random", "--num-prompts", "20",
                 "--input-len", "24", "--output-len", "8", "--range-ratio", "0.5",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--enforce-eager",
                 "--row-bins", "2,4,8", "--token-bins", "32,64",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    steps, bins, totals = r["steps"], r["bins"], r["totals"]

    # Every step the engine ran, each once, in order: their tokens are the prompts' plus every
    # output token but each request's last (sampled, never fed back), one sampled row a token.
    requests = sample_requests("random", 20, TINY["vocab_size"], seed=r["args"]["seed"],
                               input_len=24, output_len=8, range_ratio=0.5,
                               max_model_len=TINY["max_position_embeddings"])
    outputs = sum(q.output_len for q in requests)
    assert len(steps) == r["engine_steps"] == totals["steps"] > 0
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert sum(s["real_tokens"] for s in steps) == sum(q.prompt_len for q in requests) \
        + outputs - len(requests)
    assert sum(s["sample_rows"] for s in steps) == r["output_tokens"] == outputs
    assert any(s["decode"] for s in steps) and any(not s["decode"] for s in steps)

    done = [s["done_ms"] for s in steps]
    assert done == sorted(done)
    for s in steps:
        assert s["real_tokens"] <= s["bucket_tokens"] and s["real_rows"] <= s["bucket_rows"]
        assert s["sample_rows"] <= s["bucket_rows"] and s["seqs"] <= s["bucket_rows"]
        assert 0 < s["exact_floor_ms"] <= s["floor_ms"]
        assert 0 <= s["device_ms"] <= s["interval_ms"] + 1e-9
        assert s["kv_tokens"] >= s["seqs"] and s["pairs"] >= s["real_tokens"]
        if s["decode"]:
            assert s["real_tokens"] == s["real_rows"] and s["bucket_tokens"] == s["bucket_rows"]

    # The bins partition the steps: their sums are the totals.
    for key in ("steps", "host_bound_steps"):
        assert sum(b[key] for b in bins) == totals[key]
    for key in ("interval_s", "floor_s", "exact_floor_s", "lost_s", "padding_s", "wall_share"):
        assert sum(b[key] for b in bins) == pytest.approx(totals[key])
    assert totals["interval_s"] + totals["tail_s"] == pytest.approx(totals["wall_s"])
    assert totals["exact_floor_s"] <= totals["floor_s"]
    for b in bins:
        assert b["mean_real_rows"] <= b["mean_bucket_rows"]
        assert b["mean_real_tokens"] <= b["mean_bucket_tokens"]
    # Decode-only bins first, then mixed, each from small to large.
    lower = lambda name: int(name.split()[1].lstrip(">").split("-")[0])
    names = [b["bin"] for b in bins]
    assert names == sorted(names, key=lambda n: (n.startswith("mixed"), lower(n)))
    printed = capsys.readouterr().out
    assert all(b["bin"] in printed for b in bins) and "with zero padding" in printed


def test_causal_pairs_with_and_without_a_window():
    # Tokens at positions 3, 4, 5 see 4, 5, 6 keys; with a window of 5: 4, 5, 5.
    assert _pairs(3, 3, None) == 15 and _pairs(3, 3, 5) == 14
    assert _pairs(0, 1, None) == 1 and _pairs(10, 1, 4) == 4 and _pairs(0, 4, 2) == 1 + 2 + 2 + 2
