"""``--kv-cache-dtype fp8``: the KV pool in float8_e4m3fn (scale 1, as vLLM without calibrated
scales). Its blocks cost a quarter of a float32 pool's bytes; the kernels (interpreted) read FP8
pages as the reference does; swapping and recomputing preempted sequences change nothing; the
outputs stay close to the float pool's."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.pallas_kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_mixed,
    paged_attention_prefill,
    paged_attention_reference,
)
from paged_attention_cases import decode_chunks, make_case
from test_engine import (
    BLOCK,
    CFG,
    SMALL_POOL,
    assert_no_leak,
    make_engine,
    run_all,
    workload,
)
from tiny_models import TINY_QWEN, random_params

import jaxllm
from jaxllm import LLM, SamplingParams
from jaxllm.kv_pool import kv_block_bytes, kv_cache_dtype, to_pool_dtype
from jaxllm.layers.fp8 import Fp8Weight
from jaxllm.loading import LoadedModel

FP8 = jnp.float8_e4m3fn


@functools.cache
def tiny_model() -> LoadedModel:
    return LoadedModel("tiny", CFG, random_params(CFG, seed=21), None, jnp.float32)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_names_and_saturation():
    assert kv_cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert kv_cache_dtype("fp8", jnp.bfloat16) == FP8
    with pytest.raises(ValueError, match="--kv-cache-dtype fp16: must be one of auto, fp8"):
        kv_cache_dtype("fp16", jnp.bfloat16)
    # Past e4m3's largest value a plain cast gives NaN; the pool saturates instead.
    x = jnp.asarray([1.0, -3.3, 1000.0, -1e6], jnp.float32)
    assert np.isnan(np.asarray(x.astype(FP8), np.float32)).any()
    np.testing.assert_array_equal(np.asarray(to_pool_dtype(x, FP8), np.float32),
                                  [1.0, -3.25, 448.0, -448.0])
    assert kv_block_bytes(CFG, BLOCK, FP8) * 4 == kv_block_bytes(CFG, BLOCK, jnp.float32)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_interpreted_kernels_read_fp8_pages_as_the_reference(kernel):
    """bf16 queries over FP8 pages: the kernel widens each page to bf16 as it reads it."""
    chunks = decode_chunks([1, 40, 300]) if kernel == "decode" else [(0, 17), (15, 3), (40, 1)]
    case = make_case(chunks, block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=16,
                     dtype=jnp.bfloat16, seed=4)
    q, k, v, *rest = case.args
    args = (q, to_pool_dtype(k, FP8), to_pool_dtype(v, FP8), *rest)
    run = paged_attention_decode if kernel == "decode" else paged_attention_prefill
    out = run(*args, scale=case.scale, interpret=True)
    ref = paged_attention_reference(*args, scale=case.scale)
    n = case.num_real_tokens
    out, ref = np.asarray(out, np.float32)[:n], np.asarray(ref, np.float32)[:n]
    np.testing.assert_allclose(out, ref, atol=2e-2, rtol=2e-2)


KERNELS = {"decode": paged_attention_decode, "prefill": paged_attention_prefill,
           "mixed": paged_attention_mixed}


def _llama3_fp8_case(kernel: str, decodes: list, chunks: list):
    """(the kernel, its arguments over FP8 pages, the case): Llama-3-8B's heads, bf16 queries;
    ``decodes`` for decode and mixed, ``chunks`` (prompt chunks) for prefill and mixed."""
    case = make_case({"decode": decodes, "prefill": chunks, "mixed": decodes + chunks}[kernel],
                     block_size=16, num_q_heads=32, num_kv_heads=8, head_dim=128,
                     dtype=jnp.bfloat16, seed=5)
    q, k, v, *rest = case.args
    return KERNELS[kernel], (q, to_pool_dtype(k, FP8), to_pool_dtype(v, FP8), *rest), case


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_over_fp8_pages_lower_to_triton_for_hopper(kernel, monkeypatch):
    """The Triton lowering (what failed on the H200: no integer-to-FP8 cast for a masked
    load's fill value) runs on any host: JAX's GPU query is answered with an sm_90 device."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                        lambda: types.SimpleNamespace(compute_capability=90))
    run, args, case = _llama3_fp8_case(kernel, decode_chunks([5, 40]), [(0, 30), (40, 7)])
    lowered = jax.jit(lambda *a: run(*a, scale=case.scale)).trace(*args).lower(
        lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("kernel", KERNELS)
def test_compiled_kernels_read_fp8_pages_as_the_reference_on_gpu(kernel):
    """The Triton kernels as the engine runs them on a GPU (engine-like lengths) over FP8
    pages, against the reference over the same pages."""
    decodes = decode_chunks(np.random.default_rng(7).integers(1, 2048, size=64).tolist())
    run, args, case = _llama3_fp8_case(kernel, decodes, [(0, 300), (512, 64), (1500, 7)])
    out = run(*args, scale=case.scale)
    ref = paged_attention_reference(*args, scale=case.scale)
    n = case.num_real_tokens
    out, ref = np.asarray(out, np.float32)[:n], np.asarray(ref, np.float32)[:n]
    np.testing.assert_allclose(out, ref, atol=2e-2, rtol=2e-2)


def _greedy(kv: str, **args) -> tuple:
    return _greedy_cached(kv, tuple(sorted(args.items())))


@functools.cache
def _greedy_cached(kv: str, args: tuple) -> tuple:
    prompts, max_tokens = workload(10, seed=1)
    engine = make_engine(tiny_model(), kv_cache_dtype=kv, **dict(args))
    assert engine.runner.kv_pool.dtype == kv_cache_dtype(kv, jnp.float32)
    outs = run_all(engine, prompts, max_tokens)
    assert_no_leak(engine)
    return tuple(tuple(o.outputs[0].token_ids) for o in outs), engine.scheduler.num_preemptions


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_get_the_tokens_they_get_unpreempted(model, mode):
    tokens, _ = _greedy("fp8")
    preempted, count = _greedy("fp8", **SMALL_POOL, preemption_mode=mode,
                               swap_space=0.01)
    assert count > 0 and preempted == tokens


def test_outputs_stay_close_to_the_float_pool(model):
    """FP8 keys and values keep 3 mantissa bits: most greedy tokens agree with the float32
    pool's, and the first step's top log-probabilities (its prompt attends over FP8 pages)
    stay within 0.1."""
    fp8, _ = _greedy("fp8")
    full, _ = _greedy("auto")
    same = sum(a == b for seq_a, seq_b in zip(fp8, full, strict=True)
               for a, b in zip(seq_a, seq_b, strict=True))
    # Measured: 100 of 135 (a random tiny model's greedy margins are thin; one flipped token
    # changes the rest of its sequence).
    assert same >= 0.6 * sum(map(len, full)), (same, sum(map(len, full)))
    prompt = workload(1, seed=3)[0][0]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    logprobs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model, kv_cache_dtype=kv, max_num_seqs=2, max_num_batched_tokens=32,
                  max_model_len=128, block_size=BLOCK, num_gpu_blocks_override=32,
                  enforce_eager=True, compilation_cache_dir=None, progress=False)
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        top = out[0].outputs[0].logprobs[0]
        logprobs[kv] = {t: float(lp) for t, lp in top.items()}
    for token, value in logprobs["auto"].items():
        assert abs(logprobs["fp8"].get(token, -np.inf) - value) < 0.1, logprobs


def test_the_pool_holds_four_times_the_blocks_of_a_float32_pool(model):
    blocks = {}
    # Room for 20 float32 blocks: below the 129 the engine's limits could ever use.
    space = 20 * kv_block_bytes(CFG, BLOCK, jnp.float32) / 2**30
    for kv in ("auto", "fp8"):
        engine = make_engine(model, kv_cache_dtype=kv, num_gpu_blocks_override=None,
                             cpu_kv_cache_space=space)
        blocks[kv] = engine.block_manager.num_gpu_blocks
    assert blocks == {"auto": 20, "fp8": 80}, blocks
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' must be one of"):
        make_engine(model, kv_cache_dtype="int4")


def test_fp8_weights_compose_with_the_fp8_pool():
    """``--quantization fp8 --kv-cache-dtype fp8`` (W8A8 projections over FP8 pages): the pool
    is FP8, the projections' kernels stay FP8, and greedy tokens mostly agree with the same
    FP8 weights over a float pool."""
    model = jaxllm.load_model(TINY_QWEN, dtype="float32", quantization="fp8")
    assert any(isinstance(leaf, Fp8Weight) for leaf in jax.tree.leaves(
        model.params, is_leaf=lambda x: isinstance(x, Fp8Weight)))
    prompts = [[int(t) for t in np.random.default_rng(s).integers(1, 100, 12)] for s in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model, kv_cache_dtype=kv, max_num_seqs=4, max_num_batched_tokens=32,
                  max_model_len=64, block_size=BLOCK, num_gpu_blocks_override=32,
                  enforce_eager=True, compilation_cache_dir=None, progress=False)
        assert (llm.engine.runner.kv_pool.dtype == FP8) == (kv == "fp8")
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        tokens[kv] = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(seq) == 8 for seq in tokens["fp8"])
    same = sum(a == b for x, y in zip(tokens["fp8"], tokens["auto"], strict=True)
               for a, b in zip(x, y, strict=True))
    # Measured: 28 of 32 (a random tiny model's greedy margins are thin; one flipped token
    # changes the rest of its sequence)
    assert same >= 0.6 * 32, tokens
