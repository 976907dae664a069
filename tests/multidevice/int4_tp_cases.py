"""4-bit checkpoints under tensor parallelism, on forced host devices (run by
``tests/test_tensor_parallel.py`` in the tensor-parallel cases' process): the packed words,
scales and zero points split as the float kernel they stand for, a sharded model gives the
one-device model's tokens, and a size that would cut a group across devices is refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from test_quant_int4 import write_tiny

import jaxllm
from jaxllm.layers.linear import Int4Weight

assert jax.device_count() == 4, "run through tests/test_tensor_parallel.py (4 host devices)"


def greedy_tokens(model) -> list[list[int]]:
    llm = jaxllm.LLM(model, max_num_seqs=2, max_model_len=64, enforce_eager=True,
                     compilation_cache_dir=None, progress=False)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [20, 30, 40, 50, 60, 70, 80]]
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=jaxllm.SamplingParams(temperature=0, max_tokens=5))
    return [o.outputs[0].token_ids for o in outs]


# AWQ with groups of 32 rows; GPTQ with one group over all rows (group_size -1).
@pytest.mark.parametrize("method, group", [("awq", 32), ("gptq", -1)])
def test_int4_weights_split_as_the_float_kernel(tmp_path, method, group):
    path = write_tiny(tmp_path, method, group)
    one = jaxllm.load_model(path, dtype="float32")
    two = jaxllm.load_model(path, dtype="float32", tensor_parallel_size=2)
    layers = two.params["layers"]
    qkv, down = layers["attn"]["qkv_proj"]["kernel"], layers["mlp"]["down_proj"]["kernel"]
    assert isinstance(qkv, Int4Weight)
    column, row = PartitionSpec(None, None, "tp"), PartitionSpec(None, "tp", None)
    for part in (qkv.qweight, qkv.scales, qkv.zeros, down.qweight):
        assert part.sharding.spec == (row if part is down.qweight else column), part
    if group == -1:  # one group over all rows: every input shard uses it
        assert down.scales.sharding.spec == PartitionSpec(None, None, None)
    else:
        assert down.scales.sharding.spec == row and down.zeros.sharding.spec == row
    # Read shard by shard, the same values as read whole.
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if method == "awq":  # one engine pair: the same forward
        assert greedy_tokens(two) == greedy_tokens(one)
    moved = one.with_tensor_parallel(2)
    assert moved.params["layers"]["mlp"]["down_proj"]["kernel"].qweight.sharding.spec == row


def test_a_split_cutting_groups_is_refused_at_load(tmp_path):
    path = write_tiny(tmp_path, "awq", 64)
    with pytest.raises(ValueError, match="cuts its groups of 64 rows"):
        jaxllm.load_model(path, tensor_parallel_size=4)
