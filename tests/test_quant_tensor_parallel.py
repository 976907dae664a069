"""4-bit checkpoints under tensor parallelism: the packed words, scales and zero points split
as the float kernel they stand for, a sharded model gives the one-device model's tokens, and a
size that would cut a group across devices is refused before any weight is read. The cases
run in a process of their own with four forced host devices (this file run as a script), so
every other test keeps one device."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_int4_cases_on_four_host_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + " --xla_force_host_platform_device_count=4").strip()
    result = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=HERE, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert result.stdout.splitlines()[-1] == "int4 tensor-parallel cases passed", result.stdout


def test_a_split_that_cuts_a_group_is_refused():
    from jaxllm.model_config import ModelConfig
    from jaxllm.quantization import resolve_quantization
    from jaxllm.quantization.int4_checkpoint import check_int4_layout

    config = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 256})
    awq = resolve_quantization(None, {"quant_method": "awq", "bits": 4, "group_size": 64})
    check_int4_layout(config, awq, 2)  # down_proj: 64 rows a device, one group each
    with pytest.raises(ValueError, match="--tensor-parallel-size 4: mlp.down_proj's 128 "
                                         "inputs split into 32 per device, which cuts"):
        check_int4_layout(config, awq, 4)


def run_cases(tmp: pathlib.Path) -> None:
    import conftest  # noqa: F401  (the tests' environment, set before jax is imported)
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec
    from test_quant_int4 import write_tiny

    import jaxllm
    from jaxllm.layers.linear import Int4Weight

    assert jax.device_count() == 4
    engine_args = dict(max_num_seqs=2, max_model_len=64, enforce_eager=True,
                       compilation_cache_dir=None, progress=False)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [20, 30, 40, 50, 60, 70, 80]]
    sampling = jaxllm.SamplingParams(temperature=0, max_tokens=5)

    def tokens(model):
        llm = jaxllm.LLM(model, **engine_args)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sampling, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    for method, group in (("awq", 32), ("gptq", -1)):
        path = write_tiny(tmp, method, group)
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
        if method == "awq":  # one engine pair (~10 s each on 2 cores): the same forward
            assert tokens(two) == tokens(one), method
        moved = one.with_tensor_parallel(2)
        assert moved.params["layers"]["mlp"]["down_proj"]["kernel"].qweight.sharding.spec == row
    path = write_tiny(tmp, "awq", 64)
    try:
        jaxllm.load_model(path, tensor_parallel_size=4)
    except ValueError as e:
        assert "cuts its groups of 64 rows" in str(e), e
    else:
        raise AssertionError("a split cutting groups was not refused")
    print("int4 tensor-parallel cases passed")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    with tempfile.TemporaryDirectory() as tmp:
        run_cases(pathlib.Path(tmp))
