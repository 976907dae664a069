"""Per-request pooling parameters (embeddings), with vLLM's names, and the host-side end of
pooling: the engine sums each chunk's hidden states on the device
(:func:`jaxllm.models.pooling.pool_hidden`) and finishes the embedding here."""

from __future__ import annotations

import dataclasses

import numpy as np

POOLING_TYPES = ("LAST", "MEAN")


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """How a prompt becomes one embedding: the final-normed hidden state of its last token
    (``LAST``, what a causal model's last position has read) or the mean over every prompt
    position (``MEAN``); ``normalize`` scales it to unit L2 norm (what cosine similarity
    wants, and vLLM's default)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        kind = str(self.pooling_type).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")
        object.__setattr__(self, "pooling_type", kind)
        if not isinstance(self.normalize, bool):
            raise ValueError("normalize must be true or false")

    @property
    def needs_every_position(self) -> bool:
        """MEAN reads every prompt position's hidden state, so no position may come from the
        prefix cache (whose blocks hold K/V, not hidden states)."""
        return self.pooling_type == "MEAN"


def finish_embedding(params: PoolingParams, last: np.ndarray, total: np.ndarray | None,
                     num_tokens: int) -> np.ndarray:
    """The request's embedding (f32[H]) from its last position's hidden state and the sum of
    every position's (None for LAST)."""
    vector = (total / num_tokens if params.pooling_type == "MEAN" else last).astype(np.float32)
    if params.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector
