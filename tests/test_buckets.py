"""Step shape buckets: few enough to compile ahead, fine enough that padding stays small."""

from __future__ import annotations

import pytest

from jaxllm.engine.buckets import BucketSpec, batch_sizes, token_sizes


def _max_gap(size: int) -> int:
    """The largest step the ladder may take from ``size`` (jaxllm.engine.buckets says why)."""
    if size < 128:
        return size  # doubling: small steps are memory-bound, padding is nearly free
    octave = 1 << (size.bit_length() - 1)
    return max(64, octave // 4 if size < 2048 else octave // 2)


@pytest.mark.parametrize("ladder, lo", [(batch_sizes, 1), (token_sizes, 16)])
@pytest.mark.parametrize("hi", [1, 3, 16, 100, 256, 1000, 1024, 2048, 4096, 8192, 16384])
def test_ladders_bound_padding_and_count(ladder, lo, hi):
    sizes = ladder(hi)
    assert list(sizes) == sorted(set(sizes)) and sizes[0] == min(lo, hi) and sizes[-1] == hi
    for small, large in zip(sizes, sizes[1:], strict=False):
        assert large - small <= _max_gap(small), (small, large)
    for n in range(sizes[0] + 1, hi + 1):  # padding: at most 25% past 256, up to 2048
        bucket = next(s for s in sizes if s >= n)
        if 256 < n <= 2048:
            assert bucket <= 1.25 * n, (n, bucket)
    # Each bucket is one more forward (and, for batch sizes, sampler) compile at warm-up:
    # eight doublings, four sizes an octave to 2048, two beyond.
    assert len(sizes) <= 8 + 4 * 4 + 2 * max(0, (hi - 1).bit_length() - 11)


def test_the_ladders():
    assert batch_sizes(256) == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)
    assert batch_sizes(1024)[7:] == (128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
    assert len(batch_sizes(1024)) == 18  # was 11 (powers of two)
    assert token_sizes(8192) == (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896,
                                 1024, 1280, 1536, 1792, 2048, 3072, 4096, 6144, 8192)
    assert token_sizes(16384)[-3:] == (8192, 12288, 16384) and len(token_sizes(16384)) == 24


def test_a_step_gets_the_smallest_bucket_that_holds_it():
    spec = BucketSpec.build(256, 2048, 64, bucket_table_width=True)
    mixed = spec.shape_for(num_tokens=555, num_seqs=250, num_rows=250, max_blocks=10)
    assert (mixed.num_tokens, mixed.num_seqs, mixed.is_decode) == (640, 256, False)
    decode = spec.shape_for(num_tokens=200, num_seqs=200, num_rows=200, max_blocks=10)
    assert (decode.num_tokens, decode.num_seqs, decode.is_decode) == (256, 256, True)
    assert spec.shape_for(130, 130, 130, 10).num_tokens == 192
    assert mixed.table_width == decode.table_width == 16
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        spec.shape_for(num_tokens=2049, num_seqs=1, num_rows=1, max_blocks=10)
    with pytest.raises(ValueError, match="exceed the largest batch bucket"):
        spec.shape_for(num_tokens=300, num_seqs=257, num_rows=257, max_blocks=10)


@pytest.mark.parametrize("seqs, tokens", [(256, 2048), (1024, 8192), (1000, 16384), (8, 10)])
def test_every_step_lands_on_a_warmed_shape(seqs, tokens):
    """Warm-up compiles ``all_shapes`` (and a sampler per row count): whatever the scheduler
    hands over within the limits must be one of them, or it would compile mid-run."""
    spec = BucketSpec.build(seqs, tokens, 64, bucket_table_width=True)
    warmed = set(spec.all_shapes())
    for width in (1, 3, 64):
        for n in range(1, seqs + 1):  # decode-only steps, every size
            assert spec.shape_for(n, n, n, width) in warmed
        for t in range(2, tokens + 1, 1 if tokens <= 2048 else 7):  # mixed steps
            rows = min(t - 1, seqs)
            assert spec.shape_for(t, rows, rows, width) in warmed
            assert spec.shape_for(t, 1, 1, width) in warmed
    # One ladder rule for both: a mixed bucket's rows are a batch bucket, so the samplers
    # compile once per decode size and never for a row count of their own.
    assert {s.num_seqs for s in warmed} == set(spec.batch_sizes)


def test_bucket_padding_benchmark_runs(tmp_path):
    """``bench bucket_padding`` (the docstring's table) runs on a small workload; where the
    new ladders hold every old bucket (budgets up to 2048), they pad no more than before."""
    import json

    from jaxllm.benchmarks.bucket_padding import main

    out = tmp_path / "padding.json"
    assert main(["--num-prompts", "120", "--limits", "200x2048", "--output-json",
                 str(out)]) == 0
    report = json.loads(out.read_text())
    total = next(r for r in report["padding"] if r["kind"] == "all")
    assert total["unpadded_ms"] <= total["modelled_ms"]["now"] <= total["modelled_ms"]["before"]
    now = next(r for r in report["warm_up"] if r["buckets"] == "now")
    spec = BucketSpec.build(200, 2048, 512, bucket_table_width=False)
    assert now["forwards"] == len(spec.all_shapes()) == 10 + 18  # 1 .. 128, 192, 200
