"""Every sampling sequence's sampler settings as a numpy row, written once per sequence.

A sequence's sampling parameters, seed and prompt length never change, so they are written
to a row when it first samples (``batch`` meets a new seq id) and the row is freed when its
request finishes (``remove``). A step's :class:`~jaxllm.sampler_rows.SamplerBatch` is then a
gather of those rows plus each row's token count: no ``SamplerInput`` per row per step,
and ``sample_variant`` / ``build_sampling_metadata`` read columns (the way
``jaxllm.engine.block_table`` serves block tables)::

    seq 12 -> row 0: temperature 0.0  top_p 1.0 ... seed 77  prompt 1024  min_tokens 0
    seq 15 -> row 1: temperature 0.8  top_p 0.9 ... seed 3   prompt 31    min_tokens 4
                     banned [1 2 -1 ...] (EOS + stop ids, only while below min_tokens)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jaxllm.engine.scheduler_output import ScheduledSample
from jaxllm.sampler_rows import (
    ROW_FIELDS,
    SamplerBatch,
    SampleVariant,
    needs_penalties,
    needs_top_k_top_p,
)
from jaxllm.sampling import PAD_ID
from jaxllm.sampling_params import SamplingParams

# Per-row settings besides ROW_FIELDS' (steps is the one field that changes every step).
_STATIC = tuple((name, dtype) for name, _, dtype in ROW_FIELDS if name != "steps") + (
    ("min_tokens", np.int32), ("num_logprobs", np.int32), ("num_banned", np.int32),
    ("penalties", bool), ("greedy", bool), ("top_k_top_p", bool), ("structured", bool))


class SamplerTable:
    def __init__(self, banned_ids: Callable[[SamplingParams], tuple[int, ...]],
                 num_rows: int = 64) -> None:
        self._banned_of = banned_ids  # the ids a request bans below its min_tokens
        self.cols = {name: np.zeros(num_rows, dtype) for name, dtype in _STATIC}
        self.banned = np.full((num_rows, 1), PAD_ID, np.int32)  # i32[rows, K]
        self.rows: dict[int, int] = {}  # seq id -> row
        self._free = list(range(num_rows - 1, -1, -1))  # popped from the end: row 0 first

    def batch(self, samples: Sequence[ScheduledSample]) -> SamplerBatch:
        """The step's sample rows (row i = samples[i]) as sampler columns."""
        seqs = [s.seq for s in samples]
        get = self.rows.__getitem__
        try:
            rows = np.fromiter(map(get, [q.seq_id for q in seqs]), np.intp, len(seqs))
        except KeyError:  # a sequence's first sample: write its row
            for s in samples:
                if s.seq.seq_id not in self.rows:
                    self._add(s)
            rows = np.fromiter(map(get, [q.seq_id for q in seqs]), np.intp, len(seqs))
        c = self.cols
        columns = {name: c[name][rows] for name, _, _ in ROW_FIELDS if name != "steps"}
        # Tokens generated so far (before this step's placeholder is appended).
        steps = np.fromiter(map(len, [q.token_ids for q in seqs]), np.int32, len(seqs))
        steps -= columns["num_prompt_tokens"]
        columns["steps"] = steps
        banning = steps < c["min_tokens"][rows]  # [N]  EOS and stop ids banned this step
        width = int(c["num_banned"][rows][banning].max(initial=0))
        banned = np.where(banning[:, None], self.banned[rows, :width], PAD_ID)  # [N, K']
        penalties = c["penalties"][rows]
        token_ids = [(int(i), seqs[i].token_ids) for i in np.flatnonzero(penalties)]
        greedy = c["greedy"][rows]
        variant = SampleVariant(
            num_logprobs=int(c["num_logprobs"][rows].max(initial=0)),
            use_penalties=bool(penalties.any()), all_greedy=bool(greedy.all()),
            use_top_k_top_p=bool(c["top_k_top_p"][rows].any()),
            use_bitmask=bool(c["structured"][rows].any()))
        return SamplerBatch(columns, banned, token_ids, variant)

    def constrained(self, samples: Sequence[ScheduledSample]) -> list[int]:
        """The sample rows under a grammar (every row has a table row: ``batch`` first)."""
        rows = np.fromiter(map(self.rows.__getitem__, [s.seq.seq_id for s in samples]),
                           np.intp, len(samples))
        return np.flatnonzero(self.cols["structured"][rows]).tolist()

    def remove(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def _add(self, sample: ScheduledSample) -> None:
        params, seq = sample.group.params, sample.seq
        if not self._free:
            self._grow()
        row = self.rows[seq.seq_id] = self._free.pop()
        banned = self._banned_of(params) if params.min_tokens else ()
        values = {name: getattr(params, name) for name, _, _ in ROW_FIELDS[:7]}
        values.update(
            seeds=seq.seed & 0xFFFFFFFF, num_prompt_tokens=seq.num_prompt_tokens,
            min_tokens=params.min_tokens, num_logprobs=params.logprobs or 0,
            num_banned=len(banned), penalties=needs_penalties(params),
            greedy=params.is_greedy,
            top_k_top_p=needs_top_k_top_p(params),
            structured=params.structured_outputs is not None)
        for name, value in values.items():
            self.cols[name][row] = value
        if len(banned) > self.banned.shape[1]:
            grown = np.full((len(self.banned), len(banned)), PAD_ID, np.int32)
            grown[:, :self.banned.shape[1]] = self.banned
            self.banned = grown
        self.banned[row] = PAD_ID
        self.banned[row, :len(banned)] = banned

    def _grow(self) -> None:
        old = len(self.banned)
        self.cols = {name: np.concatenate([col, np.zeros_like(col)])
                     for name, col in self.cols.items()}
        self.banned = np.concatenate([self.banned, np.full_like(self.banned, PAD_ID)])
        self._free = list(range(2 * old - 1, old - 1, -1))
