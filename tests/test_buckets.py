"""Step shape buckets: few enough to compile ahead, fine enough that padding stays small."""

from __future__ import annotations

import pytest

from jaxllm.engine.buckets import BucketSpec


@pytest.mark.parametrize("max_tokens", [16, 100, 512, 1000, 2048, 4096, 8192, 16384])
def test_token_buckets_bound_padding_and_count(max_tokens):
    spec = BucketSpec.build(256, max_tokens, 512, bucket_table_width=False)
    sizes = spec.token_sizes
    assert list(sizes) == sorted(set(sizes)) and sizes[-1] == max_tokens
    assert len(sizes) <= 16  # each bucket is one more compile at warm-up
    for small, large in zip(sizes, sizes[1:], strict=False):
        # Small steps double (memory-bound: padding is cheap); large ones grow by at most
        # 256 tokens up to 2048 and by an eighth of the budget beyond.
        assert large <= 2 * small or large - small <= max(256, -(-max_tokens // 8 // 256) * 256)


def test_a_step_gets_the_smallest_bucket_that_holds_it():
    spec = BucketSpec.build(256, 2048, 64, bucket_table_width=True)
    assert spec.token_sizes == (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    mixed = spec.shape_for(num_tokens=555, num_seqs=250, num_rows=250, max_blocks=10)
    assert (mixed.num_tokens, mixed.num_seqs, mixed.is_decode) == (768, 256, False)
    decode = spec.shape_for(num_tokens=200, num_seqs=200, num_rows=200, max_blocks=10)
    assert (decode.num_tokens, decode.num_seqs, decode.is_decode) == (256, 256, True)
    assert mixed.table_width == decode.table_width == 16
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        spec.shape_for(num_tokens=2049, num_seqs=1, num_rows=1, max_blocks=10)
    warmed = set(spec.all_shapes())  # warm-up compiles these: every step must be one of them
    for tokens in range(1, 2049, 7):
        seqs = min(tokens, 256)
        assert spec.shape_for(tokens, seqs, seqs, 64) in warmed
        assert spec.shape_for(tokens, 1, 1, 3) in warmed
