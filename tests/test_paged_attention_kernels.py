"""The Pallas paged-attention kernels against the float32 reference.

Every suite runs twice: ``...Interpret`` classes run the kernels in the Pallas interpreter on
CPU (CI); ``...GPU`` classes compile them with Triton and skip without a GPU.
The dtype x block size x head-shape grids are marked ``kernel_grid`` (part of the default run;
``-m "not kernel_grid"`` keeps a smoke subset). Compiled on a GPU they run the full grid; in
the interpreter (CPU, ~4 s a case) a pairwise covering: every pair of values at least once.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.pallas_kernels.paged_attention import (
    DecodeConfig,
    PrefillConfig,
    kernels_support,
    paged_attention_decode,
    paged_attention_mixed,
    paged_attention_prefill,
    paged_attention_reference,
)
from jaxllm.pallas_kernels.paged_attention.shapes import AWKWARD_LENGTHS, HEAD_SHAPES
from paged_attention_cases import TOLERANCES, decode_chunks, make_case

from jaxllm.attention import is_decode_batch, paged_attention, resolve_backend
from jaxllm.batch import BatchMetadata
from jaxllm.kv_pool import KVPool

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

ON_GPU = jax.default_backend() == "gpu"
DTYPES = [jnp.float32, jnp.bfloat16]
BLOCK_SIZES = [8, 16, 32]
GRID_HEADS = ["small_gqa", "small_mha", "odd_group"]
FULL_GRID = [(h, b, d) for h in GRID_HEADS for b in BLOCK_SIZES for d in DTYPES]
# Half the grid, yet every (heads, block size), (heads, dtype) and (block size, dtype) pair.
PAIRWISE_GRID = [(h, b, DTYPES[(i + j) % 2]) for i, h in enumerate(GRID_HEADS)
                 for j, b in enumerate(BLOCK_SIZES)]


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("kernel_grid"):
        grid = PAIRWISE_GRID if metafunc.cls.INTERPRET else FULL_GRID
        metafunc.parametrize("heads, block_size, dtype", grid, ids=[
            f"{h}-{b}-{'f32' if d == jnp.float32 else 'bf16'}" for h, b, d in grid])
# Prompt chunks over cached prefixes, decodes, a full 1023-token prefill and an empty slot.
MIXED_CHUNKS = [(0, 1), (16, 1), (0, 17), (15, 3), (510, 3), (0, 513), (1000, 23), (1022, 1)]


reference = jax.jit(paged_attention_reference, static_argnames=("scale", "sliding_window"))


def check(kernel, case, dtype, **kwargs):
    out = kernel(*case.args, scale=case.scale, sliding_window=case.sliding_window, **kwargs)
    ref = reference(*case.args, scale=case.scale, sliding_window=case.sliding_window)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    n = case.num_real_tokens
    assert out.shape == ref.shape and np.isfinite(out).all()
    np.testing.assert_allclose(out[:n], ref[:n], **TOLERANCES[dtype])
    np.testing.assert_array_equal(out[n:], 0.0)  # padding tokens: written, and 0
    rel = np.linalg.norm(out[:n] - ref[:n]) / np.linalg.norm(ref[:n])
    assert rel < (1e-5 if dtype == jnp.float32 else 1e-2), rel


def case_for(chunks, head_name, block_size, dtype, **kwargs):
    h = HEAD_SHAPES[head_name]
    return make_case(chunks, block_size=block_size, num_q_heads=h.num_q_heads,
                     num_kv_heads=h.num_kv_heads, head_dim=h.head_dim, dtype=dtype, **kwargs)


class DecodeSuite:
    INTERPRET = True

    def run(self, case, dtype, **config):
        kernel = functools.partial(paged_attention_decode, interpret=self.INTERPRET,
                                   config=DecodeConfig(**config))
        check(kernel, case, dtype)

    @pytest.mark.kernel_grid  # parametrized by pytest_generate_tests
    def test_awkward_lengths_grid(self, heads, block_size, dtype):
        case = case_for(decode_chunks(AWKWARD_LENGTHS), heads, block_size, dtype,
                        seed=block_size, extra_tokens=1)
        self.run(case, dtype)

    @pytest.mark.parametrize("num_splits", [1, 3, 16])
    def test_split_k(self, num_splits):
        case = case_for(decode_chunks([1, 40, 513, 1023]), "small_gqa", 16, jnp.float32)
        self.run(case, jnp.float32, num_splits=num_splits, block_kv=32)

    def test_sliding_window(self):
        case = case_for(decode_chunks([3, 17, 100, 513]), "small_gqa", 16, jnp.float32,
                        sliding_window=37)
        self.run(case, jnp.float32, num_splits=2, block_kv=32)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
    def test_head_dim_128(self, dtype):
        case = case_for(decode_chunks([17, 300]), "llama3_8b", 16, dtype)
        self.run(case, dtype)

    def test_any_batch_is_correct(self):
        """Prompt chunks through the decode kernel: slow, but the same numbers."""
        case = case_for(MIXED_CHUNKS[:4], "small_gqa", 8, jnp.float32)
        self.run(case, jnp.float32, block_kv=16)

    @pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "three_splits"])
    @pytest.mark.parametrize("q_heads,kv_heads", [(32, 8), (12, 4)], ids=["G4", "G3"])
    def test_unpadded_query_groups(self, q_heads, kv_heads, num_splits):
        """q read in place: G = 4 or 3 real rows of a 16-row tile, the next kv head's rows right
        after them in q and in the output; padding tokens still give 0."""
        case = make_case(decode_chunks([1, 17, 100, 300]), block_size=16, num_q_heads=q_heads,
                         num_kv_heads=kv_heads, head_dim=32, seed=q_heads, extra_tokens=2)
        self.run(case, jnp.float32, num_splits=num_splits, block_kv=32)


class PrefillSuite:
    INTERPRET = True

    def run(self, case, dtype, **config):
        kernel = functools.partial(paged_attention_prefill, interpret=self.INTERPRET,
                                   config=PrefillConfig(**config))
        check(kernel, case, dtype)

    @pytest.mark.kernel_grid  # parametrized by pytest_generate_tests
    def test_mixed_batch_grid(self, heads, block_size, dtype):
        case = case_for(MIXED_CHUNKS, heads, block_size, dtype, seed=block_size)
        self.run(case, dtype)

    @pytest.mark.parametrize("block_q_rows,block_kv", [(16, 16), (64, 32), (128, 64)])
    def test_tile_sizes(self, block_q_rows, block_kv):
        case = case_for(MIXED_CHUNKS, "small_gqa", 16, jnp.float32, seed=3)
        self.run(case, jnp.float32, block_q_rows=block_q_rows, block_kv=block_kv)

    def test_sliding_window(self):
        case = case_for(MIXED_CHUNKS, "small_gqa", 16, jnp.float32, sliding_window=37)
        self.run(case, jnp.float32, block_q_rows=32, block_kv=32)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
    def test_head_dim_128(self, dtype):
        case = case_for([(0, 70), (40, 33), (99, 1)], "llama3_8b", 16, dtype)
        self.run(case, dtype)

    def test_decode_batch(self):
        case = case_for(decode_chunks(AWKWARD_LENGTHS), "smollm2_135m", 16, jnp.bfloat16)
        self.run(case, jnp.bfloat16)

    def test_launch_order_leaves_the_output_alone(self):
        """heavy_first only reorders the grid: every program writes the same rows."""
        case = case_for(MIXED_CHUNKS, "small_gqa", 16, jnp.float32, seed=5)
        outs = [np.asarray(paged_attention_prefill(
            *case.args, scale=case.scale, interpret=self.INTERPRET,
            config=PrefillConfig(block_q_rows=32, block_kv=32, heavy_first=first)))
            for first in (False, True)]
        np.testing.assert_array_equal(outs[0], outs[1])


class MixedSuite:
    """Decodes and last tokens through the decode kernel, the rest through the prefill kernel."""

    INTERPRET = True

    def run(self, case, dtype, **prefill):
        kernel = functools.partial(paged_attention_mixed, interpret=self.INTERPRET,
                                   prefill_config=PrefillConfig(**prefill),
                                   decode_config=DecodeConfig(block_kv=32))
        check(kernel, case, dtype)

    @pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
    @pytest.mark.parametrize("heads", GRID_HEADS)
    def test_mixed_batch(self, heads, dtype):
        case = case_for(MIXED_CHUNKS, heads, 16, dtype, seed=5)
        self.run(case, dtype)

    def test_decodes_with_one_prompt_chunk_and_padding(self):
        """The engine's steady state: many decodes, a chunk, padded tokens and empty slots."""
        chunks = decode_chunks([1, 40, 300, 17, 1023, 5]) + [(64, 40)] + decode_chunks([9])
        case = case_for(chunks, "small_gqa", 16, jnp.float32, extra_tokens=7, extra_seqs=2)
        self.run(case, jnp.float32, block_q_rows=32, block_kv=32)

    def test_only_decodes_and_only_chunks(self):
        self.run(case_for(decode_chunks([3, 70]), "small_gqa", 8, jnp.float32), jnp.float32)
        self.run(case_for([(0, 20), (30, 5)], "small_gqa", 8, jnp.float32), jnp.float32)

    def test_sliding_window(self):
        case = case_for(MIXED_CHUNKS, "small_gqa", 16, jnp.float32, sliding_window=37)
        self.run(case, jnp.float32, block_q_rows=32, block_kv=32)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
    def test_head_dim_128(self, dtype):
        case = case_for([(0, 70), (40, 1), (99, 1), (5, 33)], "llama3_8b", 16, dtype)
        self.run(case, dtype)


class TestDecodeInterpret(DecodeSuite):
    INTERPRET = True


class TestPrefillInterpret(PrefillSuite):
    INTERPRET = True


class TestMixedInterpret(MixedSuite):
    INTERPRET = True


gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@pytest.mark.gpu
@gpu_only
class TestDecodeGPU(DecodeSuite):
    INTERPRET = False

    def test_large_batch(self):
        rng = np.random.default_rng(0)
        lengths = rng.integers(1, 4096, size=64).tolist()
        case = case_for(decode_chunks(lengths), "llama3_8b", 16, jnp.bfloat16)
        self.run(case, jnp.bfloat16)


@pytest.mark.gpu
@gpu_only
class TestPrefillGPU(PrefillSuite):
    INTERPRET = False

    def test_long_chunks(self):
        case = case_for([(2048, 512), (0, 2048), (8000, 100)], "llama3_8b", 16, jnp.bfloat16)
        self.run(case, jnp.bfloat16)


@pytest.mark.gpu
@gpu_only
class TestMixedGPU(MixedSuite):
    INTERPRET = False

    def test_engine_sized_step(self):
        """~256 decodes over 1k contexts with two prompt chunks, Llama-3-8B heads."""
        rng = np.random.default_rng(1)
        chunks = decode_chunks(rng.integers(1, 1024, size=250).tolist()) + [(0, 300), (512, 64)]
        case = case_for(chunks, "llama3_8b", 16, jnp.bfloat16, extra_tokens=100)
        self.run(case, jnp.bfloat16)


def test_split_combine_is_the_softmax_over_every_split():
    """combine_splits' one-pass merge against the weights computed whole in float64: splits
    far apart in scale, an empty split beside full ones, a token whose splits are all empty."""
    from jaxllm.pallas_kernels.paged_attention.decode import combine_splits
    rng = np.random.default_rng(0)
    o = rng.standard_normal((3, 5, 4, 8)).astype(np.float32)  # [T, K, Hq, D]
    lse = (rng.standard_normal((3, 5, 4)) * 40).astype(np.float32)
    lse[0, 2] = -np.inf
    o[0, 2] = 0.0  # what the kernel writes for a split with no key
    lse[2] = -np.inf
    o[2] = 0.0
    got = np.asarray(combine_splits(jnp.asarray(o), jnp.asarray(lse), jnp.float32))
    weights = np.exp2(lse[:2].astype(np.float64) - lse[:2].max(axis=1, keepdims=True))
    want = (o[:2] * weights[..., None]).sum(axis=1) / weights.sum(axis=1)[..., None]
    np.testing.assert_allclose(got[:2], want, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(got[2], 0.0)


# --- dispatch ---------------------------------------------------------------------------------


def batch_of(case) -> tuple[jax.Array, KVPool, BatchMetadata]:
    q, k, v = case.args[:3]
    return q, KVPool(k, v), case.batch


def test_auto_backend_is_reference_on_cpu_the_hopper_kernels_on_hopper_and_triton_elsewhere():
    hopper = ON_GPU and getattr(jax.devices()[0], "compute_capability", None) == "9.0"
    assert resolve_backend("auto") == (
        "pallas_mosaic" if hopper else "pallas" if ON_GPU else "reference")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("triton")


def test_decode_batches_are_recognised_by_shape():
    case = case_for(decode_chunks([3, 17]), "small_gqa", 16, jnp.float32, extra_tokens=1)
    q, _, batch = batch_of(case)
    assert is_decode_batch(q, batch)
    case = case_for([(0, 5), (3, 1)], "small_gqa", 16, jnp.float32)
    q, _, batch = batch_of(case)
    assert not is_decode_batch(q, batch)


@pytest.mark.parametrize("chunks", [decode_chunks([3, 40]), MIXED_CHUNKS[:4]],
                         ids=["decode", "mixed"])
def test_dispatch_interpret_matches_reference(chunks):
    case = case_for(chunks, "small_gqa", 8, jnp.float32, extra_tokens=1)
    q, pool, batch = batch_of(case)
    run = lambda backend: np.asarray(paged_attention(
        q, pool, case.args[3], batch, scale=case.scale, sliding_window=None, backend=backend))
    n = case.num_real_tokens
    np.testing.assert_allclose(run("pallas_interpret")[:n], run("reference")[:n],
                               **TOLERANCES[jnp.float32])


def test_unsupported_head_dim_falls_back_to_reference():
    case = make_case([(0, 3)], block_size=8, num_q_heads=2, num_kv_heads=1, head_dim=24)
    assert not kernels_support(*case.args[:3])
    q, pool, batch = batch_of(case)
    out = paged_attention(q, pool, case.args[3], batch, scale=case.scale, sliding_window=None,
                          backend="pallas_interpret")
    ref = paged_attention_reference(*case.args, scale=case.scale)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_decode(*case.args, scale=case.scale, interpret=True)


# --- through the model ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mistral_sliding", "qwen2_bias"])
def test_tiny_model_logits_interpret_match_reference(name):
    """Chunked prefill then decode steps, kernel path vs reference path, same logits."""
    from tiny_models import TINY_CONFIGS, PagedRunner, random_params

    cfg = TINY_CONFIGS[name]
    params = random_params(cfg)
    tokens = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 23))
    table = [5, 2, 9, 7, 11, 3, 8]
    logits = {}
    for backend in ("reference", "pallas_interpret"):
        runner = PagedRunner(cfg, params, block_size=4, num_blocks=16, backend=backend)
        logits[backend] = runner.run(tokens, [9, 11, 1, 1, 1], table)
    np.testing.assert_allclose(logits["pallas_interpret"], logits["reference"], atol=1e-4,
                               rtol=1e-4)
