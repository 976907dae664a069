"""Padded shape buckets for the jitted step, so that nothing compiles after warm-up.

A step's arrays have three sizes: T tokens, S sequences (= R sampled rows) and W block-table
columns. Decode-only steps use T = S = a batch-size bucket (1, 2, 4, ..., max_num_seqs);
steps holding any prompt chunk use T = a token bucket and S = min(T, the largest batch bucket).
Token buckets are powers of two up to 256, then every 256 tokens (coarser past a 2048-token
budget): past a few hundred tokens a step's matmuls are compute-bound, so a padded token costs
as much as a real one, and a steady mix of ~256 decode rows plus a few prompt chunks would
otherwise pad ~550 tokens to 1024.
W is a power of two (the reference attention's cost grows with W) or, for kernels whose cost
follows the real lengths, always the maximum.
"""

from __future__ import annotations

import bisect
import dataclasses


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    sizes, size = [], lo
    while size < hi:
        sizes.append(size)
        size *= 2
    sizes.append(hi)
    return tuple(sorted(set(sizes)))


def _token_sizes(hi: int) -> tuple[int, ...]:
    step = 256 * max(1, -(-hi // (8 * 256)))  # at most ~8 large buckets: each one compiles
    small = _powers_of_two(min(16, hi), min(step, hi))
    return tuple(sorted({*small, *range(step, hi, step), hi}))


@dataclasses.dataclass(frozen=True)
class StepShape:
    num_tokens: int  # T
    num_seqs: int  # S (= number of sample rows R)
    table_width: int  # W
    is_decode: bool  # one token per sequence (a mixed bucket may also have T == S)


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    batch_sizes: tuple[int, ...]  # decode-only steps: T = S
    token_sizes: tuple[int, ...]  # steps with prompt chunks: T
    table_widths: tuple[int, ...]

    @classmethod
    def build(cls, max_num_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int,
              bucket_table_width: bool) -> BucketSpec:
        batch = _powers_of_two(1, max_num_seqs)
        tokens = _token_sizes(max_num_batched_tokens)
        widths = (_powers_of_two(min(4, max_blocks_per_seq), max_blocks_per_seq)
                  if bucket_table_width
                  else (max_blocks_per_seq,))
        return cls(batch, tokens, widths)

    def shape_for(self, num_tokens: int, num_seqs: int, num_rows: int,
                  max_blocks: int) -> StepShape:
        width = _ceil(self.table_widths, max_blocks)
        if num_tokens == num_seqs == num_rows:
            size = _ceil(self.batch_sizes, num_tokens)
            return StepShape(size, size, width, True)
        tokens = _ceil(self.token_sizes, max(num_tokens, num_rows))
        seqs = min(tokens, self.batch_sizes[-1])
        if seqs < max(num_seqs, num_rows):
            raise ValueError(f"{num_seqs} sequences / {num_rows} rows exceed the largest "
                             f"batch bucket {self.batch_sizes[-1]}")
        return StepShape(tokens, seqs, width, False)

    def all_shapes(self) -> list[StepShape]:
        shapes = [StepShape(b, b, w, True) for b in self.batch_sizes for w in self.table_widths]
        shapes += [StepShape(t, min(t, self.batch_sizes[-1]), w, False)
                   for t in self.token_sizes for w in self.table_widths]
        return list(dict.fromkeys(shapes))


def _ceil(sizes: tuple[int, ...], value: int) -> int:
    i = bisect.bisect_left(sizes, value)
    if i == len(sizes):
        raise ValueError(f"{value} exceeds the largest bucket {sizes[-1]}")
    return sizes[i]
