"""Pipeline parallelism on forced host devices (run by ``tests/test_tensor_parallel.py`` in the
tensor-parallel cases' process, with four host devices): PP = 2, and PP = 2 x TP = 2, give the
greedy tokens of one device through the engine (chunked prefill, four requests running, prefix
caching) and ``LLM``; the layers and the KV pool are split by stage; more micro-batches than
stages (a sequence cut between them) give one device's logits; a checkpoint loads each stage's
layers onto its own devices; the benchmark commands take ``-pp``."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.benchmarks import jax_backends, throughput
from jaxllm.benchmarks.__main__ import build_parser
from jaxllm.benchmarks.__main__ import main as bench_main
from test_engine import BLOCK, make_engine, run_all
from test_loading import TINY_DIR
from tiny_models import TINY_CONFIGS, random_params

import jaxllm
from jaxllm import LLM, SamplingParams, SeqChunk, make_forward, pack_batch
from jaxllm.kv_pool import new_kv_pool
from jaxllm.loading import LoadedModel
from jaxllm.loading.assemble import replicate_kv_heads
from jaxllm.parallel import pipeline

assert jax.device_count() == 4, "run through tests/test_tensor_parallel.py (4 host devices)"

# Small limits, so that few step shapes compile: 16-token steps cut the prompts into chunks
# (and, at PP = 2, into two 8-token micro-batches that cut some sequences in two).
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)


@functools.cache
def tiny_model(name: str = "llama3_rope_scaling", layers: int = 2) -> LoadedModel:
    cfg = dataclasses.replace(TINY_CONFIGS[name], num_hidden_layers=layers)
    return LoadedModel(name, cfg, random_params(cfg, seed=21), None, jnp.float32)


def requests():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 128, int(n)).tolist() for n in (3, 24, 17, 9, 20, 5)]
    prompts.append(prompts[1][:16] + [7, 8, 9])  # two cached blocks of the second prompt
    return prompts, [9, 6, 12, 4, 8, 10, 5]


@functools.cache
def one_device_tokens() -> list:
    engine = make_engine(tiny_model(), **LIMITS)
    return [o.outputs[0].token_ids for o in run_all(engine, *requests())]


# Stages scan their layers (TP 1), or unroll them over the stage-major per-layer layout (TP 2).
@pytest.mark.parametrize("tp, unroll", [(1, False), (2, True)])
def test_engine_at_pp2_gives_one_devices_tokens_and_splits_the_pool_by_stage(tp, unroll):
    engine = make_engine(tiny_model(), pipeline_parallel_size=2, tensor_parallel_size=tp,
                         unroll_layers=unroll, enable_prefix_caching=True, **LIMITS)
    prompts, max_tokens = requests()
    got = [o.outputs[0].token_ids for o in run_all(engine, prompts, max_tokens)]
    assert got == one_device_tokens()
    assert max(map(len, prompts)) > LIMITS["max_num_batched_tokens"]  # chunked prefill
    assert engine.block_manager.prefix_cache_hits > 0
    assert engine.model.pipeline_parallel_size == 2 and engine.model.tensor_parallel_size == tp
    assert engine.model.unroll_layers == unroll
    # Stacked: pool [2 layers, ...] and leaves [2, ...]; unrolled: one array per stage-local
    # layer, [2 stages, ...]. Either way the leading axis is split over the stages: each
    # device holds its stage's one layer of the two, its KV heads' pages of every block.
    pool = engine.runner.kv_pool
    k = pool.k[0] if unroll else pool.k
    assert k.sharding.spec[0] == "pp"
    assert {s.data.shape[:1] + s.data.shape[3:4] for s in k.addressable_shards} == {
        (1, 2 // tp)}
    stage_of = {d: i for i, row in enumerate(engine.model.mesh.devices[0]) for d in row}
    assert {stage_of[s.device] for s in k.addressable_shards if s.index[0].start == 1} == {1}
    layers = engine.model.params["layers"]
    qkv = (layers[0] if unroll else layers)["attn"]["qkv_proj"]["kernel"]
    assert qkv.sharding.spec[0] == "pp"
    assert {s.data.shape for s in qkv.addressable_shards} == {(1, *qkv.shape[1:2],
                                                               qkv.shape[2] // tp)}
    assert engine.model.params["norm"]["scale"].sharding.is_fully_replicated


def test_llm_at_pp2_gives_one_devices_tokens():
    prompts, max_tokens = requests()
    llm = LLM(tiny_model(), pipeline_parallel_size=2, block_size=BLOCK,
              num_gpu_blocks_override=160, enforce_eager=True, compilation_cache_dir=None,
              progress=False, **LIMITS)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == one_device_tokens()


def test_more_micro_batches_than_stages_give_one_devices_logits(monkeypatch):
    """Two stages, M = 4 micro-batches of 4 tokens (more than the stages: the smaller bubble
    of long steps), sequences cut between them (decode steps: the engine cases)."""
    monkeypatch.setattr(pipeline, "MIN_MICRO_BATCH_TOKENS", 4)
    assert [pipeline.num_micro_batches(t, 2) for t in (1, 2, 8, 16, 64)] == [1, 2, 2, 4, 8]
    assert pipeline.bubble_fraction(4, 2) == 1 / 5
    model = tiny_model()
    sharded = model.with_tensor_parallel(1, pipeline_parallel_size=2)
    rng = np.random.default_rng(0)
    prefill = pack_batch([SeqChunk(rng.integers(1, 100, 7).tolist(), 0, [1, 2]),
                          SeqChunk(rng.integers(1, 100, 6).tolist(), 0, [3, 4]),
                          SeqChunk(rng.integers(1, 100, 2).tolist(), 0, [5])], 4,
                         num_tokens=16, num_seqs=4, table_width=4)
    logits = {}
    for m in (model, sharded):
        forward = jax.jit(make_forward(m.config, jnp.float32, "reference", m.mesh))
        pool = new_kv_pool(m.config, 8, 4, jnp.float32, unroll_layers=False, mesh=m.mesh)
        logits[m.mesh is None] = np.asarray(forward(m.params, pool, prefill)[0])
    np.testing.assert_allclose(logits[False], logits[True], atol=2e-5, rtol=2e-5)


def test_a_checkpoint_loads_each_stage_onto_its_own_devices():
    """Each stage's devices read and stack only their layers (with TP, their block of them);
    the values are one device's."""
    path = os.path.join(TINY_DIR, "qwen2_bias")
    one = jaxllm.load_model(path, dtype="float32")
    model = jaxllm.load_model(path, dtype="float32", tensor_parallel_size=2,
                              pipeline_parallel_size=2)
    expected = replicate_kv_heads(one.params, one.config, model.config)
    for got, want in zip(jax.tree.leaves(model.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    stage_of = {d: i for i, row in enumerate(model.mesh.devices[0]) for d in row}
    qkv = model.params["layers"]["attn"]["qkv_proj"]["kernel"]  # [2 layers, H, 2 tp blocks]
    assert {(stage_of[s.device], s.index[0].start) for s in qkv.addressable_shards} == {
        (0, 0), (1, 1)}


def test_sizes_that_do_not_fit_are_refused_naming_the_flags():
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 x --pipeline-parallel-size "
                       "4: .* at most the number of visible devices .4"):
        jaxllm.load_model("llama-3-8b", load_format="dummy", tensor_parallel_size=2,
                          pipeline_parallel_size=4)
    three = LoadedModel("three", dataclasses.replace(tiny_model().config, num_hidden_layers=3),
                        None, None, jnp.float32)  # refused before its params are touched
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2: the model's 3 layers "
                       "must be divisible .* sizes that fit: 1, 3"):
        three.with_tensor_parallel(1, pipeline_parallel_size=2)


def test_benchmark_commands_take_pp(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "eos_token_id": 2}))
    model = ["--model", str(config), "--load-format", "dummy", "--dtype", "float32",
             "--no-progress"]
    out = tmp_path / "latency.json"
    assert bench_main(["latency", *model, "-pp", "2", "--batch-sizes", "2",
                       "--context-len", "16", "--iters", "2", "--warmup-iters", "1",
                       "--bandwidth-gbps", "10", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["pipeline_parallel_size"] == 2
    assert (result["rows"][0]["micro_batches"], result["rows"][0]["bubble_fraction"]) == \
        (2, 1 / 3)
    # bench throughput's engine, as its flags build it (its steps: the engine cases).
    args = build_parser().parse_args(["throughput", "--backend", "jaxllm", *model, "-pp", "2",
                                      "--max-num-seqs", "2", "--max-model-len", "32",
                                      "--enforce-eager"])
    engine = jax_backends.make_engine(throughput.load_jax_model(args), args)
    assert engine.config.pipeline_parallel_size == 2
    assert engine.runner.kv_pool.k.sharding.spec[0] == "pp"
