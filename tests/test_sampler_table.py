"""The engine's per-sequence sampler rows (jaxllm.engine.sampler_table) give the metadata,
variant and penalty width that SamplerInputs built row by row give (numpy only: no device)."""

import numpy as np

from jaxllm.engine.sampler_table import SamplerTable
from jaxllm.engine.scheduler_output import ScheduledSample
from jaxllm.engine.sequence import Sequence, SequenceGroup
from jaxllm.sampler_rows import SamplerInput, build_sampling_metadata, penalty_width, sample_variant
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams

EOS = (1,)


def banned_of(params: SamplingParams) -> tuple[int, ...]:
    return tuple(dict.fromkeys(() if params.ignore_eos else EOS + params.stop_token_ids))


def sample(seq_id: int, params: SamplingParams, prompt: int, outputs: int) -> ScheduledSample:
    seq = Sequence(seq_id, list(range(3, 3 + prompt)), seed=2**32 + 5 * seq_id)
    seq.token_ids += [7] * outputs
    return ScheduledSample(seq, seq, SequenceGroup(f"r{seq_id}", [seq], params))


def reference_rows(samples: list[ScheduledSample]) -> list[SamplerInput]:
    """The engine's rows as they were built before the table (one SamplerInput a row)."""
    rows = []
    for s in samples:
        params, seq = s.group.params, s.seq
        banned = banned_of(params) if seq.num_output_tokens < params.min_tokens else ()
        rows.append(SamplerInput(params, seq.seed, seq.num_output_tokens, banned,
                                 seq.token_ids, seq.num_prompt_tokens))
    return rows


def check_same(table: SamplerTable, samples: list[ScheduledSample], num_rows: int) -> None:
    batch, rows = table.batch(samples), reference_rows(samples)
    assert sample_variant(batch) == sample_variant(rows)
    assert penalty_width(batch) == penalty_width(rows)
    width = 64 if penalty_width(rows) else 0
    got = build_sampling_metadata(batch, num_rows, width, 4)
    want = build_sampling_metadata(rows, num_rows, width, 4)
    for name in want.__dataclass_fields__:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name


def test_table_rows_match_rows_built_per_step():
    grammar = StructuredOutputsParams(regex="[a-z]+")
    params = [SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, seed=3, min_tokens=3,
                             stop_token_ids=[5, 6]),
              SamplingParams(temperature=1.2, top_k=4, min_p=0.1, logprobs=5),
              SamplingParams(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.2,
                             frequency_penalty=0.1, min_tokens=1),
              SamplingParams(temperature=0.0, structured_outputs=grammar)]
    samples = [sample(i, p, prompt=4 + i, outputs=i % 3) for i, p in enumerate(params)]
    table = SamplerTable(banned_of, num_rows=2)  # grows past 2 rows
    check_same(table, samples, 8)
    assert table.constrained(samples) == [4]
    # A step later: every row one token longer (row 1 passes min_tokens=3 and stops banning).
    for s in samples:
        s.seq.token_ids.append(9)
    check_same(table, samples[::-1], 8)  # another order, the same rows
    # A finished sequence's row is reused by a new one, with the new one's settings.
    table.remove(samples[2].seq.seq_id)
    samples[2] = sample(99, SamplingParams(temperature=0.5, top_k=2), prompt=2, outputs=0)
    check_same(table, samples, 8)
    assert len(table.rows) == 5
    check_same(table, samples[:1], 1)  # all greedy, no penalties: the cheapest variant
    check_same(table, [], 4)
