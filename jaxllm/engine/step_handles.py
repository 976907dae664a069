"""What a step's launch hands back, the forward and the sampler apart (async scheduling launches
the next forward before this sampler's results are read): the forward prepared
(:class:`PreparedForward`) and launched (:class:`LaunchedForward`), the launched sampler
(:class:`PendingStep`) and its results on the host (:class:`StepResult`). The model runner
makes them; the step launcher, the output processor and the embeddings read them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxllm.batch import PackedBatch
from jaxllm.engine.buckets import StepShape
from jaxllm.sampling import SamplerOutput


@dataclasses.dataclass
class StepResult:
    """Host copies of one step's samples, row order = ``SchedulerOutput.sample_rows``."""

    sampled: np.ndarray  # i32[R]
    logprob: np.ndarray  # f32[R]
    top_ids: np.ndarray  # i32[R, num_logprobs]
    top_logprobs: np.ndarray  # f32[R, num_logprobs]
    shape: StepShape
    # Pooling steps only (embedding requests scheduled): the final-normed hidden state at
    # each sample row's position, and each scheduled chunk's sum over its tokens.
    pooled_last: np.ndarray | None = None  # f32[R, H]
    pooled_sums: np.ndarray | None = None  # f32[chunks, H], order = SchedulerOutput.scheduled


class PendingStep:
    """A launched step; ``wait()`` blocks until its samples are on the host."""

    def __init__(self, result: SamplerOutput, tokens: jax.Array, shape: StepShape,
                 pooled: tuple[jax.Array, jax.Array] | None = None, index: int = 0):
        self._result = result
        self._pooled = pooled
        self.tokens = tokens  # i32[max rows] sampled ids on the device, for the next step
        self.shape = shape
        self.index = index  # the runner's count of samplers launched before this one

    def wait(self) -> StepResult:
        host: SamplerOutput
        host, pooled = jax.device_get((self._result, self._pooled))
        last, sums = pooled if pooled is not None else (None, None)
        return StepResult(np.asarray(host.sampled), np.asarray(host.logprob),
                          np.asarray(host.top_ids), np.asarray(host.top_logprobs), self.shape,
                          last, sums)


@dataclasses.dataclass(frozen=True)
class PreparedForward:
    """A step's forward with its inputs on the device, ready to launch."""

    executable: object  # the step shape's compiled forward
    # On the device, in one buffer: the batch, and each token's row in the previous step's
    # samples or -1 (PackedBatch: one host-to-device copy a step instead of eight).
    batch: PackedBatch
    has_placeholders: bool  # some rows of the packed prev_rows are not -1
    shape: StepShape
    # Multi-host leader only: prepare_packed's arguments, sent to the workers at the launch.
    host: tuple | None = None


@dataclasses.dataclass(frozen=True)
class LaunchedForward:
    """A launched forward whose sampler is not launched yet."""

    logits: jax.Array  # f32[rows bucket, V] on the device
    shape: StepShape
    pooled: tuple[jax.Array, jax.Array] | None = None  # (f32[rows, H], f32[seqs, H])
    index: int = 0  # the runner's count of forwards launched before this one
