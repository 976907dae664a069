"""4-bit checkpoints under tensor parallelism, the part that needs one device: a size that
would cut a quantization group across devices is refused from the config alone. The sharded
cases (packed words split as the float kernel, a sharded model's tokens) need four devices:
``tests/multidevice/int4_tp_cases.py``, run in the tensor-parallel cases' process."""

from __future__ import annotations

import pytest


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
