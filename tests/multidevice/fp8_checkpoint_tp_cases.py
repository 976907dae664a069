"""An FP8 compressed-tensors checkpoint under tensor parallelism (run by
``tests/test_tensor_parallel.py`` with four host devices): its e4m3 rows [out, in] and scales
are read straight into their shards, its single KV head replicated, and it gives the greedy
tokens of one device."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import PartitionSpec
from test_engine import make_engine, run_all
from test_quant_fp8_checkpoint import FIXTURES, reference

import jaxllm
from jaxllm.loading.assemble import replicate_kv_heads

assert jax.device_count() == 4, "run through tests/test_tensor_parallel.py (4 host devices)"


def test_fp8_checkpoint_splits_and_gives_the_tokens_of_one_device():
    path = os.path.join(FIXTURES, "fp8_tensor")  # 1 KV head: replicated at TP 2 and 4
    prompt = reference("fp8_tensor")["input_ids"][:20].tolist()
    tokens = {}
    for tp in (1, 4):
        model = jaxllm.load_model(path, dtype="float32", tensor_parallel_size=tp)
        engine = make_engine(model)
        tokens[tp] = run_all(engine, [prompt], [8])[0].outputs[0].token_ids
    assert tokens[4] == tokens[1]
    layers = model.params["layers"]
    qkv, down = layers["attn"]["qkv_proj"]["kernel"], layers["mlp"]["down_proj"]["kernel"]
    assert qkv.qt.sharding.spec == PartitionSpec(None, "tp", None)  # [L, N, K]: N split
    assert down.qt.sharding.spec == PartitionSpec(None, None, "tp")  # K split
    assert model.config.num_key_value_heads == 4
    # What each device read from the file is the one-device weight with its KV rows repeated.
    one = jaxllm.load_model(path, dtype="float32")
    expected = replicate_kv_heads(one.params, one.config, model.config)
    for got, want in zip(jax.tree.leaves(model.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
