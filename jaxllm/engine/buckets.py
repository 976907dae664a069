"""Padded shape buckets for the jitted step, so that nothing compiles after warm-up.

A step's arrays have three sizes: T tokens, S sequences (= R sampled rows) and W block-table
columns. Decode-only steps use T = S = a batch-size bucket (``batch_sizes``: 1 ..
max_num_seqs); steps holding any prompt chunk use T = a token bucket (``token_sizes``: 16 ..
max_num_batched_tokens) and S = min(T, the largest batch bucket).
Both ladders follow one rule (``_ladder``): powers of two up to 128, then four sizes an octave
(steps of a quarter of the octave's start, at least 64) up to 2048, then two an octave:

    1 2 4 ... 128 192 256 320 384 448 512 640 768 896 1024 1280 ... 2048 3072 4096 6144 8192 ...

Why: a small step reads all the weights whatever its size (memory-bound: padding is nearly
free), but past ~150 rows (Llama-3-8B on an H200: 3.35 ms of weight reads against ~0.023 ms
of GEMM a token) a padded row costs as much as a real one. Powers of two padded a decode step
of 881 rows to 1024 (14% of a step's GEMM work, a trace at 1024 sequences); the finer steps
bound the padding at 25% between 256 and 2048 rows. ``jaxllm.benchmarks.bucket_padding``
(a model of the scheduler over 1000 sharegpt-like prompts, padding priced by that roofline)
gives the trade against the number of programs each bucket compiles (padded time: what the
padding adds to those steps' modelled time):

    limits       step    ladder             buckets  padded time
    256/2048     decode  powers of two        9        4.9%
                         this rule           10        2.0%
    1024/8192    decode  powers of two       11       21.3%
                         this rule           18        5.9%
                         every 64 past 128   22        4.3%
    2048 tokens  mixed   before (256 steps)  12       27.0%  (served at 10 req/s)
                         this rule           18        9.1%
    8192 tokens  mixed   before (1024 steps) 14       33.2%  (served at 10 req/s)
                         this rule           22        9.1%

Past 2048 tokens, two sizes an octave: such mixed steps are a burst's prefill, nearly always
full (padding ~0% offline), while each bucket there is an expensive compile. The same rule for
both ladders keeps S of every mixed bucket a batch bucket (max_num_batched_tokens >=
max_num_seqs), so samplers compile once per decode size. Warm-up programs (forwards + 3
sampler variants a row count): 48 -> 58 at 256/2048, 58 -> 94 at 1024/8192, 59 -> 96 at
1024/16384.
W is a power of two (the reference attention's cost grows with W) or, for kernels whose cost
follows the real lengths, always the maximum.
"""

from __future__ import annotations

import bisect
import dataclasses

DOUBLING_UP_TO = 128  # powers of two below this: small steps are memory-bound
FINE_UP_TO = 2048  # four sizes an octave below this, two above
MIN_STEP = 64


def _ladder(lo: int, hi: int) -> tuple[int, ...]:
    """``lo`` .. ``hi`` by the rule in the module docstring; always ends at ``hi``."""
    sizes, size = [], lo
    while size < hi:
        sizes.append(size)
        octave = 1 << (size.bit_length() - 1)  # the power of two at or below size
        if size < DOUBLING_UP_TO:
            size = 2 * octave
        else:
            size += max(MIN_STEP, octave // (4 if size < FINE_UP_TO else 2))
    sizes.append(hi)
    return tuple(sizes)


def batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Decode-only steps' buckets (T = S)."""
    return _ladder(1, max_num_seqs)


def token_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Mixed steps' token buckets (a prompt chunk is rarely under 16 tokens)."""
    return _ladder(min(16, max_num_batched_tokens), max_num_batched_tokens)


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    sizes, size = [], lo
    while size < hi:
        sizes.append(size)
        size *= 2
    sizes.append(hi)
    return tuple(sorted(set(sizes)))


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
        batch = batch_sizes(max_num_seqs)
        tokens = token_sizes(max_num_batched_tokens)
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
