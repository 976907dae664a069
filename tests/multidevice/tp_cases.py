"""Tensor parallelism on forced host devices (run by ``tests/test_tensor_parallel.py`` in its
own process, with ``--xla_force_host_platform_device_count=4``): every parallel size gives
the tokens one device gives, through ``LLM``, ``generate()`` and the server, with chunked
prefill, prefix caching and both preemption modes; sizes a model cannot take are refused
before any weight is read; no step compiles after warm-up."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMOLLM2_ENGINE_ARGS
from jax.sharding import PartitionSpec
from jaxllm.serve.args import ServerConfig
from jaxllm.serve.server import BackgroundServer
from test_engine import BLOCK, SMALL_POOL, make_engine, run_all, workload
from test_loading import TINY_DIR, reference
from test_sampling_parity import completion_body, post
from tiny_models import TINY_CONFIGS, random_params

import jaxllm
from jaxllm import LLM, AsyncLLMEngine, SamplingParams
from jaxllm.cli import main as cli_main
from jaxllm.loading import LoadedModel
from jaxllm.loading.assemble import StackedLeaf, hf_leaves, replicate_kv_heads
from jaxllm.loading.safetensors_io import open_checkpoint
from jaxllm.parallel import param_shardings

assert jax.device_count() == 4, "run through tests/test_tensor_parallel.py (4 host devices)"

# qwen2_bias: 4 query heads, 1 KV head (replicated at TP 2 and 4), q/k/v biases;
# llama3_rope_scaling: 4 query heads, 2 KV heads (split at TP 2, replicated at TP 4).


@functools.cache
def tiny_model(name: str) -> LoadedModel:
    cfg = TINY_CONFIGS[name]
    return LoadedModel(name, cfg, random_params(cfg, seed=21), None, jnp.float32)


def greedy(model, prompts, max_tokens, **engine_args):
    engine = make_engine(model, **engine_args)
    outs = run_all(engine, prompts, max_tokens)
    return [o.outputs[0].token_ids for o in outs], engine


def test_params_and_pool_are_split_as_the_table_says():
    tiny = tiny_model("qwen2_bias")
    engine = make_engine(tiny, tensor_parallel_size=2)
    params = engine.model.params
    assert engine.model.tensor_parallel_size == 2
    assert params["layers"]["attn"]["qkv_proj"]["kernel"].sharding.spec == \
        PartitionSpec(None, None, "tp")
    assert params["layers"]["mlp"]["down_proj"]["kernel"].sharding.spec == \
        PartitionSpec(None, "tp", None)
    assert params["norm"]["scale"].sharding.is_fully_replicated
    pool = engine.runner.kv_pool
    assert pool.k.sharding.spec == PartitionSpec(None, None, None, "tp", None)
    # Each device holds its KV heads' pages of every block: max(Hkv, TP) / TP heads each.
    kv_heads = max(tiny.config.num_key_value_heads, 2)
    assert engine.model.config.num_key_value_heads == kv_heads
    assert {s.data.shape[3] for s in pool.k.addressable_shards} == {kv_heads // 2}


# KV heads split (2 over 2 devices) and replicated (1 onto 4 devices, with q/k/v biases).
@pytest.mark.parametrize("name, tp", [("llama3_rope_scaling", 2), ("qwen2_bias", 4)])
def test_chunked_prefill_and_prefix_caching_give_the_tokens_of_one_device(name, tp):
    tiny = tiny_model(name)
    prompts, max_tokens = workload(10, seed=3)
    prompts += [prompts[0][:40] + [7, 8, 9]]  # shares cached blocks with the first prompt
    max_tokens += [12]
    args = dict(enable_prefix_caching=True)
    expected, _ = greedy(tiny, prompts, max_tokens, **args)
    got, engine = greedy(tiny, prompts, max_tokens, tensor_parallel_size=tp, **args)
    assert got == expected
    assert max(map(len, prompts)) > engine.config.max_num_batched_tokens  # chunked
    assert engine.block_manager.prefix_cache_hits > 0


@functools.cache
def one_device_greedy(name: str, seed: int, count: int) -> list:
    """One device's greedy tokens for ``workload(count, seed)``, run once for both preemption
    modes. Greedy tokens depend neither on the pool's size nor on preemption, so the engine
    has the default limits: it runs the programs the other one-device runs of the model
    already compiled (a small pool would compile its own)."""
    prompts, max_tokens = workload(count, seed=seed)
    return greedy(tiny_model(name), prompts, max_tokens)[0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_tokens_of_one_device(mode):
    tiny = tiny_model("qwen2_bias")
    prompts, max_tokens = workload(12, seed=1)
    args = SMALL_POOL | dict(preemption_mode=mode, swap_space=0.01)
    expected = one_device_greedy("qwen2_bias", 1, 12)
    got, engine = greedy(tiny, prompts, max_tokens, tensor_parallel_size=2, **args)
    assert engine.scheduler.num_preemptions > 0
    assert got == expected


def test_seeded_sampling_and_generate_match_one_device():
    tiny = tiny_model("qwen2_bias")
    prompts, _ = workload(4, seed=5)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10,
                            ignore_eos=True)
    # n = 2: the two samples share the prompt's blocks and copy the last one on write.
    fork = params.replace(n=2, max_tokens=6)
    outs = {}
    for tp in (1, 2):
        llm = LLM(tiny, tensor_parallel_size=tp, max_num_seqs=8, max_num_batched_tokens=32,
                  max_model_len=128, block_size=BLOCK, num_gpu_blocks_override=160,
                  enforce_eager=True, compilation_cache_dir=None, progress=False)
        outs[tp] = [[c.token_ids for c in o.outputs] for o in llm.generate(
            prompt_token_ids=prompts + prompts[:2],
            sampling_params=[params] * len(prompts) + [fork] * 2, use_tqdm=False)]
    assert outs[2] == outs[1]
    assert [len(o) for o in outs[2]] == [1] * len(prompts) + [2, 2]
    # generate() on sharded params: its pool is split the same way; the tokens agree.
    ids = np.zeros((len(prompts), 64), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts])
    sharded = tiny.with_tensor_parallel(4)
    one = jaxllm.generate(tiny.params, jnp.asarray(ids), lens, jax.random.key(0),
                          config=tiny.config, max_new_tokens=10)
    four = jaxllm.generate(sharded.params, jnp.asarray(ids), lens, jax.random.key(0),
                           config=sharded.config, max_new_tokens=10)
    np.testing.assert_array_equal(four.tokens, one.tokens)


def test_no_step_compiles_after_warm_up_at_tp2():
    # The default limits at TP 2, as in the chunked-prefill case: the warm-up finds the shapes
    # that case compiled in memory and compiles only the others.
    engine = make_engine(tiny_model("llama3_rope_scaling"), tensor_parallel_size=2,
                         enforce_eager=False)
    compiled = engine.runner.num_compilations
    prompts, max_tokens = workload(8, seed=4)
    run_all(engine, [p[:40] for p in prompts], max_tokens)
    assert compiled > 0 and engine.runner.num_compilations == compiled


# KV heads 2 (split at TP 2, replicated at 4) with biases; 1 (replicated) with a sliding window.
@pytest.mark.parametrize("name", ["qwen2_bias", "mistral_sliding"])
def test_hf_checkpoints_load_straight_into_their_shards(name):
    """Each device's block of every leaf, read from the checkpoint alone, is that block of the
    one-device params (KV columns replicated where the size passes the KV heads), in either
    layer layout; the sharded model still gives transformers' greedy tokens."""
    path = os.path.join(TINY_DIR, name)
    one = jaxllm.load_model(path, dtype="float32")
    ref = reference(name)
    ids = ref["input_ids"].tolist()
    for tp, unroll in ((2, False), (4, True)):
        model = jaxllm.load_model(path, dtype="float32", tensor_parallel_size=tp,
                                  unroll_layers=unroll)
        expected = dataclasses.replace(
            one, config=model.config,
            params=replicate_kv_heads(one.params, one.config, model.config)
        ).with_layer_layout(unroll).params
        for got, want in zip(jax.tree.leaves(model.params), jax.tree.leaves(expected),
                             strict=True):
            assert len(got.sharding.device_set) == tp
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        out = jaxllm.generate(model.params, jnp.asarray([ids]), jnp.asarray([len(ids)]),
                              jax.random.key(0), config=model.config, max_new_tokens=16)
        assert np.asarray(out.tokens[0]).tolist() == ref["greedy_ids"].tolist()


def test_a_leaf_reads_any_block_on_its_own():
    """What a device's callback gets: a block read from the tensors equals the whole leaf's
    block (the fused columns included), so no device needs the whole leaf; so does the block
    made on that device alone from the stored rows (each stacked layer's ``put``)."""
    path = os.path.join(TINY_DIR, "qwen2_bias")
    one = jaxllm.load_model(path, dtype="float32")
    tensors = open_checkpoint(path)
    leaves = hf_leaves(one.config, one.config, lambda n: tensors[n].get(n), set(tensors),
                       np.dtype(np.float32), path, unroll_layers=False)
    mesh = jaxllm.parallel.make_mesh(2)
    shardings = param_shardings(one.params, mesh, one.config)
    checked = 0
    for leaf, want, sharding in zip(jax.tree.leaves(leaves, is_leaf=lambda x: hasattr(x, "read")),
                                    jax.tree.leaves(one.params), jax.tree.leaves(shardings),
                                    strict=True):
        for device, index in sharding.addressable_devices_indices_map(want.shape).items():
            np.testing.assert_array_equal(leaf.read(index), np.asarray(want)[index])
            parts = [(layer, index[1:], np.asarray(want)[i]) for i, layer in
                     enumerate(leaf.layers)] if isinstance(leaf, StackedLeaf) else \
                [(leaf, index, np.asarray(want))]
            for part, part_index, whole in parts:
                block = part.put(part_index, device)
                assert block.devices() == {device}
                np.testing.assert_array_equal(block, whole[part_index])
            checked += 1
    assert checked == 2 * len(jax.tree.leaves(one.params))


def test_sizes_a_model_cannot_take_are_refused_before_any_weight_is_read(monkeypatch):
    import jaxllm.loading as loading

    def no_reads(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(loading, "assemble_params", no_reads)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2: the model's 9 attention "
                                         "heads must be divisible"):
        jaxllm.load_model(None, tensor_parallel_size=2)  # SmolLM2: 9 heads, 3 KV heads
    with pytest.raises(ValueError, match="--tensor-parallel-size 8: must be between 1 and the "
                                         "number of visible devices"):
        jaxllm.load_model(None, tensor_parallel_size=8)
    tiny = TINY_CONFIGS["llama3_rope_scaling"]
    with pytest.raises(ValueError, match="--tensor-parallel-size 3: the model's 4 attention"):
        jaxllm.load_model(None, load_format="dummy", config=tiny, tensor_parallel_size=3)


def test_smollm2_at_tp3_gives_the_tokens_of_one_device(smollm2):
    """The real SmolLM2 (9 query / 3 KV heads) split over three devices, weights streamed per
    shard from the GGUF file: LLM, the server and generate() all give TP 1's greedy tokens."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=8)
    one = jaxllm.LLM(smollm2, progress=False, **SMOLLM2_ENGINE_ARGS)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    model = jaxllm.load_model(None, dtype="float32", tensor_parallel_size=3)
    assert model.config.num_key_value_heads == 3
    llm = jaxllm.LLM(model, progress=False, **SMOLLM2_ENGINE_ARGS)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] \
        == expected
    config = ServerConfig(host="127.0.0.1", port=0, served_model_name=("tiny",),
                          disable_log_requests=True, disable_log_stats=True)
    with (BackgroundServer(AsyncLLMEngine(llm.engine), config) as server,
          concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool):
        served = list(pool.map(lambda p: post(server.url, completion_body(p, params)), prompts))
    assert [[int(t.removeprefix("token_id:")) for t in lp["tokens"]] for lp in served] \
        == expected
    ids = smollm2.tokenizer(prompts[0])["input_ids"]
    out = jaxllm.generate(model.params, jnp.asarray([ids]), jnp.asarray([len(ids)]),
                          jax.random.key(0), config=model.config, max_new_tokens=8)
    assert np.asarray(out.tokens[0]).tolist() == expected[0]


def test_jaxllm_generate_cli_at_tp3_prints_what_tp1_prints(smollm2):
    prompt, max_tokens = "The capital of France is", 6
    three = subprocess.run(
        [sys.executable, "-m", "jaxllm", "generate", "--prompt", prompt,
         "--max-tokens", str(max_tokens), "--dtype", "float32", "-tp", "3"],
        capture_output=True, text=True, timeout=600)
    assert three.returncode == 0, three.stderr[-2000:]
    # What `jaxllm generate` prints at TP 1 (its chat-templated greedy reply), computed here.
    tokenizer = smollm2.tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    out = jaxllm.generate(smollm2.params, jnp.asarray([ids]), jnp.asarray([len(ids)]),
                          jax.random.key(0), config=smollm2.config, max_new_tokens=max_tokens,
                          eos_token_ids=smollm2.config.eos_token_ids)
    tokens = np.asarray(out.tokens[0, :int(out.num_tokens[0])]).tolist()
    assert three.stdout.splitlines()[0] == tokenizer.decode(
        tokens, skip_special_tokens=True).strip()


def test_jaxllm_generate_refuses_tp2_with_exit_status_2(capsys):
    """The CLI's own entry point, in process (``python -m jaxllm`` exits with what it returns;
    the TP 3 case above runs it as a command): the refusal is a message, not a traceback,
    which here would escape main() and fail the test."""
    status = cli_main(["generate", "--prompt", "The capital of France is", "--max-tokens", "6",
                       "--dtype", "float32", "-tp", "2"])
    assert status == 2
    assert "--tensor-parallel-size 2: the model's 9 attention heads" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_weights_shard_like_the_float_ones(method):
    """Quantized pytrees split as the kernels they stand for (the scale as the output axis)
    and give the tokens of the one-device quantized model (FP8's per-token activation scale
    is taken over the whole row, across the shards)."""
    tiny = tiny_model("llama3_rope_scaling")
    prompts, max_tokens = workload(6, seed=7)
    one = tiny.with_quantization(method)
    expected, _ = greedy(one, prompts, max_tokens)
    got, engine = greedy(tiny, prompts, max_tokens, tensor_parallel_size=2,
                         quantization=method)
    assert got == expected
    layers = engine.model.params["layers"]
    qkv, down = layers["attn"]["qkv_proj"]["kernel"], layers["mlp"]["down_proj"]["kernel"]
    # int8 keeps the kernel's [L, K, N]; fp8 stores it transposed, [L, N, K].
    if method == "int8":
        assert qkv.q.sharding.spec == PartitionSpec(None, None, "tp")
        assert down.q.sharding.spec == PartitionSpec(None, "tp", None)
    else:
        assert qkv.qt.sharding.spec == PartitionSpec(None, "tp", None)
        assert down.qt.sharding.spec == PartitionSpec(None, None, "tp")
    assert qkv.scale.sharding.spec == PartitionSpec(None, "tp")
    assert down.scale.sharding.is_fully_replicated
