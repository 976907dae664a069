"""A scheduled step as the forward's padded numpy inputs (host side; no device work here).

Per step this is the one pass over the scheduled sequences besides the scheduler's own: each
row's token, position and placeholder row are read from its ``Sequence``; the block tables
come as one array from the block manager's numpy rows (``SchedulerOutput.block_tables``), and
everything else is array arithmetic in :func:`jaxllm.batch.pack_batch`.
"""

from __future__ import annotations

import numpy as np

from jaxllm.batch import BatchMetadata, SeqChunks, pack_batch
from jaxllm.engine.buckets import BucketSpec, StepShape
from jaxllm.engine.scheduler import SchedulerOutput


def pack_step(out: SchedulerOutput, buckets: BucketSpec,
              block_size: int) -> tuple[BatchMetadata, StepShape, np.ndarray | None]:
    """The scheduled chunks as one padded numpy batch. Also returns, for placeholder tokens
    (``Sequence.pending``: sampled by the previous step, still on the device), their row in
    that step's samples (else -1), or None when there are none."""
    scheduled = out.scheduled
    count = len(scheduled)
    num_new = np.fromiter([s.num_new_tokens for s in scheduled], np.int32, count)  # [C]
    num_computed = np.fromiter([s.start for s in scheduled], np.int32, count)  # [C]
    num_tokens = int(num_new.sum())
    tables = out.block_tables  # [C, W']
    shape = buckets.shape_for(num_tokens, count, len(out.sample_rows), tables.shape[1])
    prev_rows = None
    if num_tokens == count:  # one token a sequence (decode): no per-token Python
        seqs, starts = [s.seq for s in scheduled], num_computed.tolist()
        tokens = np.fromiter([q.token_ids[p] for q, p in zip(seqs, starts, strict=True)],
                             np.int32, count)
        if any(q.pending for q in seqs):
            prev = np.fromiter([q.pending.get(p, -1) if q.pending else -1
                                for q, p in zip(seqs, starts, strict=True)], np.int32, count)
            if (prev >= 0).any():
                prev_rows = np.full(shape.num_tokens, -1, np.int32)
                prev_rows[:count] = prev
    else:
        flat: list[int] = []
        for item in scheduled:
            n, first, seq = item.num_new_tokens, item.start, item.seq
            if seq.pending:
                for pos, row in seq.pending.items():
                    if first <= pos < first + n:
                        if prev_rows is None:
                            prev_rows = np.full(shape.num_tokens, -1, np.int32)
                        prev_rows[len(flat) + pos - first] = row
            flat.extend(seq.token_ids[first:first + n])
        tokens = np.asarray(flat, np.int32)
    chunk_of = {s.seq.seq_id: i for i, s in enumerate(scheduled)}
    rows = np.fromiter([chunk_of[row.source.seq_id] for row in out.sample_rows], np.int32,
                       len(out.sample_rows))
    batch = pack_batch(SeqChunks(tokens, num_new, num_computed, tables), block_size,
                       num_tokens=shape.num_tokens, num_seqs=shape.num_seqs,
                       table_width=shape.table_width, logits_rows=rows,
                       num_logits=shape.num_seqs, decode_only=shape.is_decode)
    return batch, shape, prev_rows
