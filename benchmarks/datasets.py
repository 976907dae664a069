"""Benchmark workloads: fixed token-id prompts and output lengths, deterministic from a seed.

Every backend (jaxllm, hf, jax-static, a server) gets the same :class:`Request` list, so the
runs differ only in the engine. Nothing is downloaded.

``random`` (vLLM's ``--dataset-name random``): lengths uniform in
``[len * (1 - range_ratio), len * (1 + range_ratio)]``, rounded; ``range_ratio=0`` gives fixed
lengths.

``sharegpt-like``: prompt and output lengths from log-normal distributions truncated to
``[4, 1024]`` (vLLM's ShareGPT filter drops prompts or outputs under 4 or over 1024 tokens):

    length = round(X),  ln X ~ Normal(mu, sigma) conditioned on 4 <= X <= 1024
    prompt: sigma = 1.0, mu solved so that the truncated mean is 202 tokens (median ~139)
    output: sigma = 0.8, mu solved so that the truncated mean is 179 tokens (median ~134)

The means are ShareGPT's (about 202 prompt / 179 output tokens after vLLM's filter, as quoted in
the issue); ``mu`` is solved exactly from the closed-form truncated mean at import time. The
sigmas are an assumption, not a fit to the data set (it is not downloaded here): they give the
long right tail ShareGPT is known for (about 2 % of prompts and 1 % of outputs above 800
tokens) and a median below the mean. Prompt and output lengths are drawn independently.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np

DATASETS = ("random", "sharegpt-like")
SHAREGPT_MIN_LEN, SHAREGPT_MAX_LEN = 4, 1024
SHAREGPT_PROMPT = dict(mean=202.0, sigma=1.0)
SHAREGPT_OUTPUT = dict(mean=179.0, sigma=0.8)
_NORMAL = statistics.NormalDist()


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def truncated_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[X | lo <= X <= hi] for ln X ~ Normal(mu, sigma)."""
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    mass = _phi(b) - _phi(a)
    return math.exp(mu + sigma ** 2 / 2) * (_phi(b - sigma) - _phi(a - sigma)) / mass


def solve_mu(mean: float, sigma: float, lo: float = SHAREGPT_MIN_LEN,
             hi: float = SHAREGPT_MAX_LEN) -> float:
    """The ``mu`` whose truncated log-normal has this mean (bisection; the mean rises with mu)."""
    low, high = math.log(lo) - 5 * sigma, math.log(hi) + 5 * sigma
    for _ in range(200):
        mid = (low + high) / 2
        if truncated_lognormal_mean(mid, sigma, lo, hi) < mean:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def _truncated_lognormal(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    mu = solve_mu(mean, sigma)
    # Inverse-CDF sampling inside the truncation window: exact, and one draw per value.
    a = _phi((math.log(SHAREGPT_MIN_LEN) - mu) / sigma)
    b = _phi((math.log(SHAREGPT_MAX_LEN) - mu) / sigma)
    u = a + (b - a) * rng.random(n)
    z = np.array([_NORMAL.inv_cdf(float(v)) for v in u])
    x = np.exp(mu + sigma * z)
    return np.clip(np.rint(x), SHAREGPT_MIN_LEN, SHAREGPT_MAX_LEN).astype(np.int64)


def _token_ids(rng: np.random.Generator, length: int, vocab_size: int) -> tuple[int, ...]:
    # Skip the low ids, where tokenizers keep their special tokens (BOS/EOS/pad ...).
    low = min(100, vocab_size // 2)
    return tuple(int(t) for t in rng.integers(low, vocab_size, length))


def sample_requests(dataset: str, num_prompts: int, vocab_size: int, *, seed: int = 0,
                    input_len: int = 1024, output_len: int = 128, range_ratio: float = 0.0,
                    max_model_len: int | None = None) -> list[Request]:
    """``num_prompts`` requests of ``dataset``. With ``max_model_len``, sharegpt-like prompts
    are shortened so prompt + output fits (random ones must fit as asked, or this raises)."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r} must be one of {DATASETS}")
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio={range_ratio} must be in [0, 1)")
    rng = np.random.default_rng(seed)
    if dataset == "random":
        if input_len < 1 or output_len < 1:
            raise ValueError(f"input_len={input_len} and output_len={output_len} must be >= 1")

        def lengths(n: int) -> np.ndarray:
            lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
            return rng.integers(lo, hi + 1, num_prompts)

        prompt_lens, output_lens = lengths(input_len), lengths(output_len)
        if max_model_len is not None and (prompt_lens + output_lens).max() > max_model_len:
            raise ValueError(f"input + output lengths reach {(prompt_lens + output_lens).max()}"
                             f" tokens, more than max_model_len={max_model_len}")
    else:
        prompt_lens = _truncated_lognormal(rng, num_prompts, **SHAREGPT_PROMPT)
        output_lens = _truncated_lognormal(rng, num_prompts, **SHAREGPT_OUTPUT)
        if max_model_len is not None:
            output_lens = np.minimum(output_lens, max_model_len - 1)
            prompt_lens = np.maximum(1, np.minimum(prompt_lens, max_model_len - output_lens))
    return [Request(_token_ids(rng, int(p), vocab_size), int(o))
            for p, o in zip(prompt_lens, output_lens, strict=True)]


def add_dataset_args(parser) -> None:
    """The workload flags shared by ``bench throughput`` and ``bench serve``."""
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset-name", "--dataset", default="random", choices=DATASETS)
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--input-len", "--random-input-len", type=int, default=1024,
                   help="random: prompt length")
    g.add_argument("--output-len", "--random-output-len", type=int, default=128,
                   help="random: output length")
    g.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in len * [1 - r, 1 + r]")
    g.add_argument("--n", type=int, default=1, help="sequences per prompt")
    g.add_argument("--seed", type=int, default=0)
