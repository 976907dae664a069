"""The sampler's host side (numpy): a step's rows (``SamplerInput`` or the engine's
``SamplerBatch`` columns) padded into ``jaxllm.sampling.SamplingMetadata``, and the cheapest
static variant of ``jaxllm.sampling.sample`` that is right for them (``sample_variant``;
``scalar_variant`` for ``generate``'s arguments).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxllm.sampling import PAD_ID, SamplingMetadata
from jaxllm.sampling_params import GREEDY_TEMPERATURE, SamplingParams


@dataclasses.dataclass(slots=True)
class SamplerInput:
    """One sequence to sample this step, as the model runner knows it.

    ``token_ids`` (prompt + output so far) is only read when the step uses penalties; a numpy
    int32 array makes the copy a memcpy, a list costs ~15 ns per token.
    """

    params: SamplingParams
    seed: int  # the user's seed, or one the engine drew; used modulo 2**32
    step: int  # tokens this sequence has generated so far
    banned_ids: tuple[int, ...] = ()  # e.g. EOS + stop_token_ids while below min_tokens
    token_ids: Sequence[int] | np.ndarray | None = None
    num_prompt_tokens: int = 0


def needs_penalties(params: SamplingParams) -> bool:
    """Whether a request needs the penalty variant of the sampler (and its token_ids)."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def needs_top_k_top_p(params: SamplingParams) -> bool:
    """Does this request filter by top-k or top-p (the variant that sorts the logits)?"""
    return not params.is_greedy and (params.top_k > 0 or params.top_p < 1.0)


# The per-row fields of SamplingMetadata: (name, padding value, dtype).
ROW_FIELDS = (("temperature", 0.0, np.float32), ("top_p", 1.0, np.float32),
              ("top_k", 0, np.int32), ("min_p", 0.0, np.float32),
              ("repetition_penalty", 1.0, np.float32), ("presence_penalty", 0.0, np.float32),
              ("frequency_penalty", 0.0, np.float32), ("seeds", 0, np.uint32),
              ("steps", 0, np.int32), ("num_prompt_tokens", 0, np.int32))


@dataclasses.dataclass(slots=True)
class SamplerBatch:
    """A step's sampler rows as columns: what ``build_sampling_metadata``, ``sample_variant``
    and ``penalty_width`` read. ``from_rows`` builds it from :class:`SamplerInput` s; the
    engine gathers it from per-sequence numpy rows written when a sequence first samples
    (``jaxllm.engine.sampler_table``), so a step costs no Python per row here."""

    columns: dict[str, np.ndarray]  # ROW_FIELDS' names -> [N] each (unpadded, their dtype)
    banned_ids: np.ndarray  # i32[N, K']  -1 padded, K' = the longest row's
    # (row, prompt + output ids) of the rows that need penalties; the engine's live lists:
    # their length is read when the metadata is built.
    token_ids: list[tuple[int, Sequence[int] | np.ndarray]]
    variant: SampleVariant

    def __len__(self) -> int:
        return len(self.columns["steps"])

    @classmethod
    def from_rows(cls, rows: Sequence[SamplerInput]) -> SamplerBatch:
        params = [r.params for r in rows]
        columns = {name: np.asarray([getattr(p, name) for p in params], dtype)
                   for name, _, dtype in ROW_FIELDS[:7]}
        columns["seeds"] = np.asarray([r.seed & 0xFFFFFFFF for r in rows], np.uint32)
        columns["steps"] = np.asarray([r.step for r in rows], np.int32)
        columns["num_prompt_tokens"] = np.asarray([r.num_prompt_tokens for r in rows], np.int32)
        banned = np.full((len(rows), max((len(r.banned_ids) for r in rows), default=0)),
                         PAD_ID, np.int32)  # [N, K']
        for i, row in enumerate(rows):
            banned[i, :len(row.banned_ids)] = row.banned_ids
        token_ids = [(i, r.token_ids) for i, r in enumerate(rows)
                     if r.token_ids is not None and needs_penalties(r.params)]
        return cls(columns, banned, token_ids, _variant(params))


def build_sampling_metadata(
    rows: Sequence[SamplerInput] | SamplerBatch,
    num_rows_bucket: int,
    penalty_width_bucket: int,
    banned_width: int,
    token_bitmask: np.ndarray | None = None,
) -> SamplingMetadata:
    """Pads ``rows`` into numpy arrays: R = num_rows_bucket, P = penalty_width_bucket, K =
    banned_width. Padding rows are greedy with neutral penalties. With P = 0 the token ids
    are not copied (use it together with ``use_penalties=False``); they are also skipped for
    rows whose penalties are neutral. ``token_bitmask`` (i32[R, W], R = num_rows_bucket) is
    the grammar's allowed tokens per row (use it with ``use_bitmask=True``).
    """
    batch = rows if isinstance(rows, SamplerBatch) else SamplerBatch.from_rows(rows)
    num = len(batch)
    if num > num_rows_bucket:
        raise ValueError(f"{num} rows do not fit num_rows_bucket={num_rows_bucket}")
    size = num_rows_bucket
    columns = {}
    for name, fill, dtype in ROW_FIELDS:
        columns[name] = np.full(size, fill, dtype)
        columns[name][:num] = batch.columns[name]
    banned = np.full((size, banned_width), PAD_ID, np.int32)  # [R, K]
    width = batch.banned_ids.shape[1]
    if width > banned_width:
        lengths = (batch.banned_ids != PAD_ID).sum(axis=1)
        i = int(np.argmax(lengths > banned_width))
        raise ValueError(f"row {i} bans {int(lengths[i])} ids; banned_width={banned_width}")
    banned[:num, :width] = batch.banned_ids
    tokens = np.full((size, penalty_width_bucket), PAD_ID, np.int32)  # [R, P]
    if penalty_width_bucket:  # neutral rows need no counts
        for i, ids in batch.token_ids:
            if len(ids) > penalty_width_bucket:
                raise ValueError(f"row {i} has {len(ids)} tokens; "
                                 f"penalty_width_bucket={penalty_width_bucket}")
            tokens[i, :len(ids)] = ids
    return SamplingMetadata(
        **columns, banned_ids=banned, token_ids=tokens,
        token_bitmask=(np.zeros((size, 0), np.int32) if token_bitmask is None
                       else token_bitmask),
    )


class SampleVariant(NamedTuple):
    """The static arguments of ``sample`` for one batch: ``sample(..., **v._asdict())``."""

    num_logprobs: int = 0
    use_penalties: bool = False
    all_greedy: bool = False
    use_top_k_top_p: bool = True
    use_bitmask: bool = False


def sample_variant(rows: Sequence[SamplerInput] | SamplerBatch) -> SampleVariant:
    """The cheapest variant of ``sample`` that is right for these rows (padding needs none).

    ``num_logprobs`` is the largest request; round it up (to 0 or 20, say) to compile less.
    """
    if isinstance(rows, SamplerBatch):
        return rows.variant
    return _variant([r.params for r in rows])


def _variant(params: Sequence[SamplingParams]) -> SampleVariant:
    return SampleVariant(
        num_logprobs=max((p.logprobs or 0 for p in params), default=0),
        use_penalties=any(needs_penalties(p) for p in params),
        all_greedy=all(p.is_greedy for p in params),
        use_top_k_top_p=any(needs_top_k_top_p(p) for p in params),
        use_bitmask=any(p.structured_outputs is not None for p in params))


def scalar_variant(*, temperature: Any = 1.0, top_k: Any = 0, top_p: Any = 1.0,
                   repetition_penalty: Any = 1.0, presence_penalty: Any = 0.0,
                   frequency_penalty: Any = 0.0) -> SampleVariant:
    """The cheapest variant of ``sample`` for settings that every row shares, as
    ``generate()`` takes them. A Python number is known here; anything else (a per-row array,
    a tracer) could hold any value, so its flag takes the general value. (min-p needs no
    flag: every variant applies it without a sort.)"""

    def known(value: Any) -> bool:
        return isinstance(value, numbers.Real)

    all_greedy = known(temperature) and temperature < GREEDY_TEMPERATURE
    neutral = (known(repetition_penalty) and repetition_penalty == 1.0
               and known(presence_penalty) and presence_penalty == 0.0
               and known(frequency_penalty) and frequency_penalty == 0.0)
    unfiltered = known(top_k) and top_k <= 0 and known(top_p) and top_p >= 1.0
    return SampleVariant(use_penalties=not neutral, all_greedy=all_greedy,
                         use_top_k_top_p=not (all_greedy or unfiltered))


def penalty_width(rows: Sequence[SamplerInput] | SamplerBatch) -> int:
    """Tokens the penalty variant must see (0 when no row needs penalties); round it up to a
    bucket before calling ``build_sampling_metadata``."""
    if isinstance(rows, SamplerBatch):
        return max((len(ids) for _, ids in rows.token_ids), default=0)
    return max((len(r.token_ids) for r in rows
                if r.token_ids is not None and needs_penalties(r.params)), default=0)
