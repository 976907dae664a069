"""Embeddings: ``LLM.embed`` / ``PoolingParams`` through the engine (chunked prefill, batched
with generation, preemption, prefix caching) on a tiny random model, against the whole
prompt's final-normed hidden states computed in one forward; SmolLM2's embeddings against
Hugging Face's (fixture); ``/v1/embeddings`` in the server tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import BLOCK, CFG, SMALL_POOL, make_engine, reference, workload

import jaxllm
from jaxllm import PoolingParams, SamplingParams, SeqChunk
from jaxllm.engine.outputs import EmbeddingRequestOutput
from jaxllm.kv_pool import new_kv_pool


@pytest.fixture(scope="module")
def model():
    from tiny_models import random_params

    return jaxllm.LoadedModel("tiny", CFG, random_params(CFG, seed=21), None, jnp.float32)


def whole_prompt_hidden(model, prompt: list[int]) -> np.ndarray:
    """f32[P, H]: every position's final-normed hidden state, the prompt in one chunk."""
    forward = jaxllm.make_forward(CFG, jnp.float32, "reference", return_hidden=True)
    blocks = -(-len(prompt) // BLOCK)
    pool = new_kv_pool(CFG, blocks + 1, BLOCK, jnp.float32, unroll_layers=False)
    batch = jaxllm.pack_batch([SeqChunk(prompt, 0, list(range(1, blocks + 1)))], BLOCK)
    _, _, hidden = forward(model.params, pool, batch)
    return np.asarray(hidden)[:len(prompt)]


def expected(model, prompt, params: PoolingParams) -> np.ndarray:
    hidden = whole_prompt_hidden(model, prompt)
    vector = hidden[-1] if params.pooling_type == "LAST" else hidden.mean(axis=0)
    return vector / np.linalg.norm(vector) if params.normalize else vector


def embed_all(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"e{i}", prompt_token_ids=p, params=params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"e{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("params", [PoolingParams(), PoolingParams("MEAN"),
                                    PoolingParams("MEAN", normalize=False)],
                         ids=["last", "mean", "mean-unnormalized"])
def test_embeddings_equal_the_whole_prompt_forward(model, params):
    """Prompts up to 69 tokens in 32-token chunks, eight at a time."""
    prompts, _ = workload(10, seed=5)
    engine = make_engine(model)
    outs = embed_all(engine, prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert isinstance(out, EmbeddingRequestOutput) and out.finish_reason == "stop"
        assert out.prompt_token_ids == prompt
        got = np.asarray(out.outputs.embedding)
        assert got.shape == (CFG.hidden_size,)
        np.testing.assert_allclose(got, expected(model, prompt, params), rtol=2e-4, atol=2e-5)
        if params.normalize:
            assert abs(np.linalg.norm(got) - 1) < 1e-5
    assert engine.stats.generation_tokens == 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_gpu_blocks - 1 and not engine._groups


def test_generation_beside_embeddings_keeps_its_tokens(model):
    """Embedding and generation requests in the same steps, preempted by recompute in a small
    pool: each generation request gets the tokens it gets alone, each embedding its own."""
    prompts, max_tokens = workload(6, seed=9)
    embed_prompts = [(p * 2)[:60] for p in workload(4, seed=10)[0]]
    engine = make_engine(model, **SMALL_POOL)
    params = PoolingParams("MEAN")
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"g{i}", prompt_token_ids=p, params=SamplingParams(
            temperature=0, max_tokens=m, ignore_eos=True))
        if i < len(embed_prompts):
            engine.add_request(f"e{i}", prompt_token_ids=embed_prompts[i], params=params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert done[f"g{i}"].outputs[0].token_ids == reference(tuple(p), m)
    for i, p in enumerate(embed_prompts):
        np.testing.assert_allclose(done[f"e{i}"].outputs.embedding,
                                   expected(model, p, params), rtol=2e-4, atol=2e-5)
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.generation_tokens == sum(max_tokens)


def test_mean_pooling_never_reads_the_prefix_cache(model):
    prompt = workload(1, seed=2)[0][0] * 3
    prompt = prompt[:90]
    engine = make_engine(model, enable_prefix_caching=True)
    first, second = (embed_all(engine, [prompt], PoolingParams("MEAN"))[0] for _ in range(2))
    assert second.num_cached_tokens == 0
    assert first.outputs.embedding == second.outputs.embedding
    last = embed_all(engine, [prompt], PoolingParams("LAST"))[0]
    assert last.num_cached_tokens > 0  # LAST only reads the final position
    np.testing.assert_allclose(last.outputs.embedding,
                               expected(model, prompt, PoolingParams()), rtol=2e-4, atol=2e-5)


def test_llm_embed_and_bad_input(model):
    llm = jaxllm.LLM(model, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                     block_size=BLOCK, num_gpu_blocks_override=64, enforce_eager=True,
                     compilation_cache_dir=None, progress=False)
    outs = llm.embed([[1, 2, 3], {"prompt_token_ids": [4, 5]}], use_tqdm=False)
    assert [len(o.outputs.embedding) for o in outs] == [CFG.hidden_size] * 2
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN"):
        PoolingParams("CLS")
    with pytest.raises(ValueError, match="give one PoolingParams or a list of 2"):
        llm.embed([[1], [2]], [PoolingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.embed([[CFG.vocab_size]], use_tqdm=False)
    with pytest.raises(ValueError, match="give one SamplingParams"):
        llm.generate([[1]], [PoolingParams()], use_tqdm=False)
    engine = llm.engine
    engine.add_request("gone", prompt_token_ids=list(range(1, 60)), params=PoolingParams())
    engine.step()
    (aborted,) = engine.abort_request("gone")
    assert aborted.finish_reason == "abort" and aborted.outputs is None
    while engine.has_unfinished_requests():
        engine.step()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_gpu_blocks - 1
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
